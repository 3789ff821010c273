"""What the device can do fast, as a plain value: ``dtype: auto`` / ``quantization: auto`` read it.

A ``Hardware`` is built by ``detect()`` from /proc/cpuinfo and torch, or by hand in tests, so
the choice it drives is a pure function of it (``engine/auto_weights.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# CPU flags that change what is fast (names as /proc/cpuinfo spells them)
INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# vector widths our own kernels are built for (trae_kernels/: AVX-512, or AVX2 with FMA)
VECTOR_FLAGS = frozenset({"avx512f", "avx2", "fma"})


@dataclass(frozen=True)
class Hardware:
    """device: "cpu" or "cuda"; cpu_flags: the CPU's feature flags that matter here;
    cuda_capability: (major, minor) of the GPU, None on CPU; cpu_vendor: /proc/cpuinfo's
    vendor id ("AuthenticAMD", "GenuineIntel"; "" where unknown)."""

    device: str = "cpu"
    cpu_flags: frozenset[str] = frozenset()
    cuda_capability: tuple[int, int] | None = None
    cpu_vendor: str = ""

    @property
    def int8_dot(self) -> bool:
        """int8 dot products in hardware (VNNI or AMX)."""
        return bool(self.cpu_flags & INT8_FLAGS)

    @property
    def bf16_math(self) -> bool:
        """bfloat16 matmuls in hardware: AVX512-BF16/AMX on CPU, Ampere (8.0) and newer GPUs."""
        if self.device == "cuda":
            return self.cuda_capability is not None and self.cuda_capability >= (8, 0)
        return bool(self.cpu_flags & BF16_FLAGS)

    @property
    def bf16_matrix_units(self) -> bool:
        """AMX tiles for bf16 (Sapphire Rapids and newer Xeons): oneDNN's bf16 matmul runs
        several times its float32 rate there, where AVX512-BF16 alone only matches it."""
        return self.device == "cpu" and "amx_bf16" in self.cpu_flags

    @property
    def bf16_matmul_outruns_float32(self) -> bool:
        """oneDNN's bf16 matmul beats its float32 one once compute-bound (many rows): with AMX,
        and on AMD CPUs with AVX512-BF16 (Zen 4 and newer: 120 SmolLM2 linears at 512 rows,
        319 ms in bf16 against 907 ms in float32 from the bf16 weight). Intel's AVX512-BF16
        without AMX runs bf16 at about half its float32 rate (170-185 against 320-340
        GFLOP/s)."""
        if self.device != "cpu":
            return False
        amd_bf16 = self.cpu_vendor == "AuthenticAMD" and "avx512_bf16" in self.cpu_flags
        return self.bf16_matrix_units or amd_bf16

    @property
    def avx512(self) -> bool:
        """AVX-512 vectors (AVX512F): which build of our kernels and which linear library
        ``auto`` picks follow from it."""
        return self.device == "cpu" and "avx512f" in self.cpu_flags

    @property
    def bf16_panels(self) -> bool:
        """bf16 weights on our own AVX2 panels (trae_kernels/onednn_calls.c) where the CPU has
        AVX2 and FMA but no AVX-512 and no bf16 matmuls (an EPYC of the Zen 3 generation):
        held and read at half float32's bytes, summed in float32, and run by the native layer
        loop's bf16 kernels. SmolLM2 there: batch-1 decode 0.55x float32's time (1.02-1.15
        against 1.84-2.10 s for 64 tokens), 32 x 100 prompts level with it, 32 x 512 1.05x
        its time (docs/performance.md)."""
        return (
            self.device == "cpu" and not self.bf16_math
            and {"avx2", "fma"} <= self.cpu_flags and not self.avx512
        )  # fmt: skip

    def slow_dtype(self, dtype: torch.dtype) -> str | None:
        """Why ``dtype`` runs slower than float32 here, or None: bf16 on a CPU without
        AVX512-BF16 or AMX, where oneDNN's bf16 matmul is its reference one (0.01-0.02
        TFLOP/s against ~130 GFLOP/s in float32 on an AVX2-only Zen 3 EPYC), so its linears
        multiply in float32 from a float32 copy (``fast_linear.widened_dtypes``) and the
        native layer loop does not take it — except where our AVX2 panels hold them
        (``bf16_panels``: faster than float32 there). ``dtype: auto`` never picks a slow
        dtype; an explicit one is said at start-up."""
        slow = dtype == torch.bfloat16 and not self.bf16_math and not self.bf16_panels
        if self.device == "cpu" and slow:
            return (
                f"{self.describe()}: bfloat16 matmuls have no hardware path on this CPU "
                "(no AVX512-BF16 or AMX; our bf16 panels are built for CPUs with AVX2 and no "
                "AVX-512); its linears multiply in float32 from float32 copies and dtype: auto "
                "(float32) serves faster"
            )
        return None

    def describe(self) -> str:
        if self.device == "cuda":
            return f"cuda capability {self.cuda_capability}"
        flags = sorted(self.cpu_flags & (INT8_FLAGS | BF16_FLAGS))
        return "cpu " + ("+".join(flags) if flags else "without int8/bf16 instructions")


def detect(device: str | torch.device = "cpu") -> Hardware:
    """The hardware a model on ``device`` runs on."""
    device = torch.device(device)
    if device.type == "cuda":
        return Hardware("cuda", cuda_capability=torch.cuda.get_device_capability(device))
    flags = _cpu_flags() & (INT8_FLAGS | BF16_FLAGS | VECTOR_FLAGS)
    return Hardware("cpu", cpu_flags=flags, cpu_vendor=cpu_vendor())


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first CPU's ``field`` line in /proc/cpuinfo ("" where there is none); read once per
    field (every packed linear asks)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The vendor id ("AuthenticAMD", "GenuineIntel", ...): which kernel library suits the CPU
    (engine/fast_linear.py)."""
    return _cpuinfo("vendor_id")
