"""The embedded support demo: real small models that ship inside PyPI packages,
converted and trained once into a local cache (see `prepare_demo`)."""

from __future__ import annotations

from typing import Any

__all__ = ["DemoAssets", "DemoSetupError", "default_cache_dir", "prepare_demo"]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m trae_groups.demo.prepare` does not import prepare twice.
    if name in __all__:
        from trae_groups.demo import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
