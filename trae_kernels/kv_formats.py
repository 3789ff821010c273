"""The compressed KV cache formats, by name, with no torch: the engine's configuration
checks a ``kv_cache_dtype`` against these names when a graph is only validated, and
``kv_quant`` turns each into its torch storage dtype."""

from __future__ import annotations

# kv_cache_dtype name -> (torch dtype name of the stored values, largest magnitude it holds)
KV_FORMATS: dict[str, tuple[str, float]] = {
    "int8": ("int8", 127.0),
    "fp8": ("float8_e4m3fn", 448.0),
}
