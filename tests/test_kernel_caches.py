"""The engine caps oneDNN's and ideep's shape caches (engine/memory.py KERNEL_CACHE_ENTRIES).

Every bf16 matmul of a new row count adds a primitive to both caches (LoRA's segments,
prefill chunks of a new length); left at their default of 1,024 entries each, a server
that sees many row counts holds close to a gigabyte in them. Each case runs in a fresh
interpreter: the libraries read their setting once, at their first primitive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from trae_groups.engine.fast_linear import packable_dtypes
from trae_groups.engine.memory import KERNEL_CACHE_ENTRIES

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)

# Builds an engine (no models: the caps are set as it starts), then runs bf16 matmuls of
# 600 row counts; prints the settings in force and the heap growth after a trim.
SCRIPT = """
import ctypes, json, os, sys
import torch
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.memory import process_memory
LLMEngine()
torch.set_num_threads(1)
a = torch.randn(16, 576, dtype=torch.bfloat16)
b = torch.randn(16, 1536, dtype=torch.bfloat16)
ctypes.CDLL(None).malloc_trim(0)
start = process_memory()["anon"]
for rows in range(1, 601):
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    torch.zeros(rows, 1536, dtype=torch.bfloat16).addmm_(x @ a.T, b)
ctypes.CDLL(None).malloc_trim(0)
print(json.dumps({
    "grown": process_memory()["anon"] - start,
    "onednn": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
    "ideep": os.environ.get("LRU_CACHE_CAPACITY"),
}))
"""


CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _run(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env.update(env_extra)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes(),
    reason="bf16 matmuls do not run on oneDNN on this CPU (no AVX512-BF16, AMX or AVX-NE-CONVERT)",
)
def test_engine_caps_the_caches_and_the_cap_bounds_their_memory():
    capped = _run({})
    assert capped["onednn"] == capped["ideep"] == str(KERNEL_CACHE_ENTRIES)
    # The libraries' own default (what a process gets without the engine's cap).
    uncapped = _run({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"})
    assert uncapped["onednn"] == "1024"  # a user's setting wins
    # 600 row counts x 2 matmuls: the default keeps 1,024 of the 1,200 primitives (641 MB
    # measured), the cap 128 (83 MB).
    assert uncapped["grown"] > 100 << 20, uncapped
    assert capped["grown"] < uncapped["grown"] * 0.4, (capped, uncapped)
