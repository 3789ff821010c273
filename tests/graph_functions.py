"""Python-node functions that test graphs import by name ("graph_functions:...")."""

from __future__ import annotations

import time

import anyio


def shout(text: str) -> str:
    return text.upper()


async def join(a: str, b: str) -> dict:
    await anyio.sleep(0)
    return {"joined": f"{a}+{b}", "n": len(a) + len(b)}


def explode(text: str) -> str:
    raise RuntimeError(f"cannot handle {text!r}")


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


async def slow_async(seconds: float) -> str:
    await anyio.sleep(seconds)
    return "done"


def retrieve(query: str) -> list[dict]:
    return [{"title": f"doc about {query}", "score": 0.9}, {"title": "other", "score": 0.1}]


def non_finite() -> dict:
    """Floats JSON cannot hold, as user code may return them."""
    return {"nan": float("nan"), "inf": float("inf"), "list": [1.5, -float("inf")], "ok": 2.5}
