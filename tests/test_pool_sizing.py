"""The pool is sized once the weights are loaded: a GPU reservation less what is in
use, a share of the available RAM on CPU, or pool_bytes; from a flag, the graph's
resources: or the default, in that order."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from trae_groups.cli import _engine_config, build_parser
from trae_groups.engine.config import (
    DEFAULT_GPU_MEMORY_RESERVATION,
    EngineConfig,
    available_memory,
    reserved_pool_bytes,
)
from trae_groups.engine.engine import LLMEngine
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.resources import ResourcesSpec, apply

GIB = 1 << 30


def test_the_gpu_reservation_less_what_is_in_use():
    # an 80 GiB device with 20 GiB in use (weights, context, neighbours): 72 - 20
    assert reserved_pool_bytes(80 * GIB, 60 * GIB, 0.9) == 52 * GIB
    assert reserved_pool_bytes(80 * GIB, 60 * GIB, 0.8) == 44 * GIB
    assert reserved_pool_bytes(80 * GIB, 4 * GIB, 0.9) == 0  # more in use than reserved
    assert EngineConfig().memory_reservation == DEFAULT_GPU_MEMORY_RESERVATION == 0.9


def test_cpu_pool_is_sized_after_the_weights_and_logs_each_llms_kv_tokens(llama_dir, caplog):
    engine = LLMEngine({"dialog": llama_dir}, EngineConfig(pool_fraction=0.002))
    assert engine.pool.num_pages == 1  # not sized before serving starts
    available = available_memory("cpu")
    with caplog.at_level(logging.INFO, logger="trae_groups.engine"):
        engine.start()
    try:
        size = engine.pool.num_pages * engine.pool.page_bytes
        assert abs(size - 0.002 * available) <= 0.2 * 0.002 * available  # RAM moves a little
        tokens = engine.kv_capacity()["dialog"]
        assert tokens == engine.pool.num_pages * engine.llms["dialog"].kv.tokens_per_page
        assert f"model dialog: the pool holds {tokens} tokens of its KV cache" in caplog.text
        assert re.search(
            r"pool: \d+ pages x \d+ bytes = .* \(0\.2% of available RAM\)", caplog.text
        )
        out = engine.generate([[5, 6, 7]])[0]  # the resized pool serves
        assert out.finished and len(out.token_ids) > 0
    finally:
        engine.shutdown()


def test_a_flag_wins_over_the_graph_which_wins_over_the_default():
    graph = ResourcesSpec(gpu_memory_reservation=0.8, weight_budget="1GiB", load_wait_s=5)
    args = build_parser().parse_args(
        ["serve", "g.yaml", "--gpu-memory-reservation", "0.75", "--weight-budget", "2GiB"]
    )
    config = apply(_engine_config(args), [graph])
    assert (config.gpu_memory_reservation, config.weight_budget) == (0.75, 2 * GIB)
    assert config.load_wait_s == 5  # no flag: the graph's
    assert apply(EngineConfig(), [ResourcesSpec()]).memory_reservation == 0.9


def test_a_bad_resources_value_is_refused_at_load_naming_file_line_and_field():
    text = "name: g\nresources:\n  gpu_memory_reservation: 1.5\n"
    with pytest.raises(GraphValidationError) as error:
        load_graph_text(text, "g.yaml")
    assert "g.yaml:2: resources: gpu_memory_reservation: must be in (0, 1]" in str(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pool_takes_the_reservation_less_what_is_in_use(llama_dir):
    config = EngineConfig(device="cuda", gpu_memory_reservation=0.5)
    engine = LLMEngine({"dialog": llama_dir}, config)
    free, total = torch.cuda.mem_get_info()
    expected = reserved_pool_bytes(total, free, 0.5)
    engine.start()
    try:
        size = engine.pool.num_pages * engine.pool.page_bytes
        assert abs(size - expected) <= 0.02 * total
    finally:
        engine.shutdown()
