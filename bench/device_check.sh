#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine with no network (docs/kernels.md):
# the GPU tests, then bench/gpu.py. It uses the machine's own torch, transformers
# and triton: this checkout is installed without dependencies (the engine and its
# benchmark need none beyond those). Results land in $OUT (default ./gpu-out):
# gpu.txt (hardware and versions), tests.txt, bench.txt and gpu.json.
#
#     bash bench/device_check.sh            # about 8-9 minutes on an H200 (estimated: (c) is new)
#     QUICK=1 bash bench/device_check.sh    # about 2 minutes: bench/gpu.py --quick
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__,
'transformers', transformers.__version__, 'triton', triton.__version__)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_triton_kernels.py tests/test_flash_attn_backend.py tests/test_decode_graphs.py 2>&1 | tee "$OUT/tests.txt"
timeout 400 python3 bench/gpu.py --out "$OUT/gpu.json" ${QUICK:+--quick} 2>&1 | tee "$OUT/bench.txt"
