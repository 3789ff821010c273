"""MemoryProfiler: where this process's memory goes, over time, for out-of-memory diagnosis.

    from trae_groups.monitor import MemoryProfiler
    profiler = MemoryProfiler(interval=1).start()   # samples every second, on a thread
    ...
    profiler.stop(); profiler.samples                # or path=..., one JSON line a sample

Each sample (``memory_sample``) holds the process's resident memory (RSS, PSS, anonymous,
file-backed), the device's (allocated, reserved, total; CUDA only), the memory pool's
pages by owner (KV pages per model, prefix-cache pages, encoder working memory, free)
and the weight bytes of every loaded model. The pool figures are the pool's own
accounting read at one instant, so they add up to its page count. ``trae serve
--memory-profile FILE`` writes the timeline; ``trae profile plot FILE -o mem.png`` draws
it (``plot_profile``). ``/metrics`` exports the same figures as gauges.

Samples are appended to the file as they are taken (JSON lines), so a process that
dies of running out of memory still leaves the timeline up to its end.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trae_groups.engine.memory import process_memory
from trae_groups.engine.protocol import EngineStats

__all__ = ["MemoryProfiler", "device_memory", "memory_sample", "plot_profile", "process_memory"]

log = logging.getLogger("trae_groups.monitor")

#: The samples a profiler keeps in memory (a day at one a second); the file keeps all.
MAX_SAMPLES = 86_400


def device_memory() -> dict[str, int]:
    """CUDA memory of this process's device: allocated by tensors, reserved by torch's
    caching allocator, and the device's total; empty without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "used": total - free,  # every process on the device
        "total": total,
    }


def pool_owners(stats: EngineStats) -> dict[str, Any]:
    """The pool's pages by owner: ``kv`` (pages in use, per LLM), ``encoder`` (working
    memory in use, per encoder worker), ``prefix_cache`` (cached pages nobody uses now,
    reusable by a later prompt), ``free``; they add up to ``pages``."""
    pool = stats.pool
    kv: dict[str, int] = {}
    encoder: dict[str, int] = {}
    for owner, pages in pool.pages_by_owner.items():
        if owner.startswith("encoder:"):
            encoder[owner.removeprefix("encoder:")] = pages
        else:
            kv[owner] = pages
    return {
        "page_bytes": pool.page_bytes,
        "pages": pool.num_pages,
        "kv": kv,
        "encoder": encoder,
        "prefix_cache": pool.cached_pages,
        "free": pool.free_pages,
    }


def memory_sample(engines: Iterable[EngineStats], started: float | None = None) -> dict[str, Any]:
    """One reading of everything (see the module's docstring); engines' figures merge."""
    now = time.time()
    sample: dict[str, Any] = {
        "time": now,
        "t": now - started if started is not None else 0.0,
        "process": process_memory(),
        "device": device_memory(),
        "pools": [],
        "weights": {},
    }
    for stats in engines:
        sample["pools"].append(pool_owners(stats))
        for model, weights in stats.weights.items():
            sample["weights"][model] = sample["weights"].get(model, 0) + weights.bytes
    return sample


def _live_stats() -> list[EngineStats]:
    from trae_groups.engine.engine import live_engines

    return [engine.engine_stats() for engine in live_engines()]


class MemoryProfiler:
    """Samples memory every ``interval`` seconds on a daemon thread into ``samples``
    (and, with ``path``, one JSON line per sample). ``stats`` gives the engines to read
    (default: every engine alive in this process)."""

    def __init__(
        self,
        interval: float = 1.0,
        path: str | Path | None = None,
        stats: Callable[[], Iterable[EngineStats]] | None = None,
    ):
        if interval <= 0:
            raise ValueError("interval: must be > 0 seconds")
        self.interval = interval
        self.path = Path(path) if path is not None else None
        self._stats = stats or _live_stats
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.time()

    def start(self) -> MemoryProfiler:
        if self._thread is not None:
            return self
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        self._started = time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="trae-memory-profiler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, after one last sample."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(10)
        self._thread = None
        self.sample()

    def sample(self) -> dict[str, Any]:
        """Take one sample now (the thread calls this every ``interval``)."""
        sample = memory_sample(self._stats(), self._started)
        self.samples.append(sample)
        del self.samples[:-MAX_SAMPLES]
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(sample) + "\n")
        return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a failed reading must not end the timeline
                log.exception("memory sample failed")
            self._stop.wait(self.interval)

    def __enter__(self) -> MemoryProfiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_profile(path: str | Path) -> list[dict[str, Any]]:
    """The samples of a profile file (a torn last line, from a killed process, is skipped)."""
    samples = []
    for line in Path(path).read_text().splitlines():
        try:
            samples.append(json.loads(line))
        except ValueError:
            continue
    return samples


def layers(samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The stacked series of a timeline, in bytes: weights per model, KV per model,
    prefix cache, encoder working memory, free pool pages (each pool's pages times its
    page size), in that order from the bottom."""
    names: dict[str, None] = {}
    rows = []
    for s in samples:
        row: dict[str, float] = {}
        for model, nbytes in s.get("weights", {}).items():
            row[f"weights: {model}"] = float(nbytes)
        for pool in s.get("pools", []):
            size = pool["page_bytes"]
            for model, pages in pool["kv"].items():
                row[f"KV: {model}"] = row.get(f"KV: {model}", 0.0) + pages * size
            cached = pool["prefix_cache"] * size
            row["prefix cache"] = row.get("prefix cache", 0.0) + cached
            working = sum(pool["encoder"].values()) * size
            row["encoder working memory"] = row.get("encoder working memory", 0.0) + working
            row["pool free"] = row.get("pool free", 0.0) + pool["free"] * size
        names.update(dict.fromkeys(row))
        rows.append(row)
    order = sorted(names, key=lambda n: (_LAYER_ORDER.index(n.split(":")[0]), n))
    return {name: [row.get(name, 0.0) for row in rows] for name in order}


_LAYER_ORDER = ["weights", "KV", "prefix cache", "encoder working memory", "pool free"]


def plot_profile(path: str | Path, out: str | Path) -> Path:
    """Draw a profile as a stacked area chart (MiB over seconds), RSS (and device memory
    in use, on a GPU) as lines over it; write a PNG. Needs matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "drawing a profile needs matplotlib: pip install 'trae-groups[plot]'"
        ) from None
    samples = read_profile(path)
    if not samples:
        raise ValueError(f"{path}: no samples")
    mib = float(1 << 20)
    t = [s.get("t", 0.0) for s in samples]
    stacked = layers(samples)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    if stacked:
        ax.stackplot(t, *[[v / mib for v in vs] for vs in stacked.values()], labels=list(stacked))
    ax.plot(t, [s["process"].get("rss", 0) / mib for s in samples], "k-", lw=1.5, label="RSS")
    if any(s.get("device") for s in samples):
        used = [s["device"].get("allocated", 0) / mib for s in samples]
        ax.plot(t, used, "r--", lw=1.5, label="device allocated")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory over time ({len(samples)} samples)")
    ax.legend(loc="upper left", fontsize="small", ncol=2)
    ax.margins(x=0)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
