"""engine/adapters.py: an adapter's config is checked against its tensors and its base,
when it is registered and again when it is loaded into a slot."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import build_lora
from trae_groups.engine.adapters import read_adapter
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.lora import LoraSlots

RANK = 4


@pytest.fixture(scope="module")
def good(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter") / "good"
    return build_lora(folder, llama_dir, r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def base(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir)


def variant(good, tmp_path, **changes):
    folder = shutil.copytree(good, tmp_path / "variant")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


BAD = [
    ({"lora_alpha": float("nan")}, "lora_alpha", "lora_alpha is nan; it must be a finite"),
    ({"lora_alpha": float("inf")}, "lora_alpha", "lora_alpha is inf"),
    ({"lora_alpha": 0}, "lora_alpha", "lora_alpha is 0"),
    ({"lora_alpha": -8}, "lora_alpha", "lora_alpha is -8"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, "lora_alpha", "alpha_pattern['q_proj'] is nan"),
    ({"r": 1_000_000_000}, "r", f"says rank 1000000000 for model.layers.0.self_attn.q_proj; its tensors in adapter_model.safetensors have rank {RANK}"),
    ({"r": 8}, "r", f"says rank 8 for model.layers.0.self_attn.q_proj; its tensors in adapter_model.safetensors have rank {RANK}"),
    ({"target_modules": ["q_proj", "v_proj", "nope_proj"]}, "target_modules", "'nope_proj', which is not a module of the base model"),
    ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, "target_modules", "'k_proj', but adapter_model.safetensors has no weights for it"),
    ({"target_modules": ".*nope.*"}, "target_modules", "matches no module of the base model"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "field", "says"), BAD)
def test_a_config_that_disagrees_is_refused_by_field(good, base, tmp_path, changes, field, says):
    folder = variant(good, tmp_path, **changes)
    with pytest.raises(ModelLoadError) as caught:
        read_adapter(folder, base, 16, torch.float32)
    assert caught.value.field == field
    assert says in caught.value.message and caught.value.message.startswith("adapter_config.json")


def test_the_good_adapter_passes(good, base):
    weights = read_adapter(good, base, 16, torch.float32)
    assert weights.rank == RANK and len(weights.modules) == 2 * base.config.num_hidden_layers


def test_a_config_broken_after_registering_fails_when_it_is_loaded(good, llama_dir, tmp_path):
    folder = shutil.copytree(good, tmp_path / "later")
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    slots = LoraSlots(
        model, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu")
    )
    slots.register("later", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    ((name, error),) = slots.make_room(["later"], set())
    assert name == "later" and isinstance(error, ModelLoadError) and error.field == "lora_alpha"
    assert slots.resident_names() == []


def test_the_field_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ModelLoadError("/a", "adapter_config.json: x", field="r")))
    assert (error.path, error.field) == ("/a", "r")
