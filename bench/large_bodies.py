"""Large request bodies against a running server: does /health stay fast, and does memory
come back?

The hardening issue's probe: N concurrent ~1 MB bodies (a graph request's text input, or one
chat message) while /health is polled every 20 ms; prints /health's latency (median, max),
how the big requests were answered (status counts), and the server's resident memory (its
process tree, from /proc) before the burst, at its peak and 5 s after it. 127.0.0.1 only;
every loop bounded. Prints, never asserts.

    trae demo --no-example --port 8011 &          # or any trae serve
    .venv/bin/python bench/large_bodies.py --port 8011 --route graph --graph support --count 60
    .venv/bin/python bench/large_bodies.py --port 8011 --route chat --model dialog --count 60
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path


def tree_rss_mb(pid: int) -> float:
    """RSS summed over ``pid`` and its descendants (the engine process is a child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(
                next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS"))
            )
        except (OSError, StopIteration):
            continue
    return total / 1024


def listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:port (from /proc/net/tcp and the fds' inodes)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[1].endswith(f":{port:04X}") and parts[3] == "0A":
            inode = parts[9]
    if inode is None:
        return None
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if fd.readlink().name == f"socket:[{inode}]":
                return int(fd.parts[2])
        except OSError:
            continue
    return None


def post(url: str, body: bytes, timeout: float) -> int:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1  # connection refused/reset or timeout


def poll(url: str, pid: int | None, timeout: float, stop, results) -> None:
    """/health every 20 ms until ``stop``; puts (latencies in ms, peak tree RSS in MB)."""
    health: list[float] = []
    peak = 0.0
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                resp.read()
        except OSError:
            pass
        health.append((time.perf_counter() - start) * 1e3)
        if pid:
            peak = max(peak, tree_rss_mb(pid))
        time.sleep(0.02)
    results.put((health, peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--route", choices=["graph", "chat"], default="graph")
    parser.add_argument("--graph", default="support", help="graph name (--route graph; the demo's)")
    parser.add_argument("--input", default="text", help="the graph's text input")
    parser.add_argument("--model", default="dialog", help="model id (--route chat)")
    parser.add_argument("--count", type=int, default=60)
    # 0.9: a body of 1 MiB of text and its JSON would pass the server's max_body_bytes (413)
    parser.add_argument("--mb", type=float, default=0.9, help="MiB of text per body")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    text = "word " * int(args.mb * (1 << 20) / 5)
    if args.route == "graph":
        url = f"{base}/v1/graphs/{args.graph}"
        body = json.dumps({"inputs": {args.input: text}}).encode()
    else:
        url = f"{base}/v1/chat/completions"
        body = json.dumps(
            {"model": args.model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        ).encode()
    pid = listener_pid(args.port)
    before = tree_rss_mb(pid) if pid else 0.0
    statuses: list[int] = []

    def one() -> None:
        statuses.append(post(url, body, args.timeout))

    # The poller is a process of its own: in this one it would wait for the GIL among the
    # 60 senders' threads, and that wait (not the server's) would show as /health's latency.
    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=poll, args=(f"{base}/health", pid, args.timeout, stop, results))
    poller.start()
    time.sleep(1.0)  # its interpreter started
    start = time.perf_counter()
    workers = [threading.Thread(target=one) for _ in range(args.count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(args.timeout)
    took = time.perf_counter() - start
    stop.set()
    health, peak = results.get(timeout=60)
    poller.join(10)
    peak = max(peak, before)
    time.sleep(5)
    after = tree_rss_mb(pid) if pid else 0.0
    print(
        f"{args.count} x {args.mb} MB {args.route} bodies in {took:.1f} s; statuses "
        f"{dict(Counter(statuses))}; /health ms median {statistics.median(health):.1f} "
        f"max {max(health):.1f} over {len(health)} polls; server RSS MB before {before:,.0f} "
        f"peak {peak:,.0f} 5 s after {after:,.0f} ({(after / before - 1) * 100 if before else 0:+.1f}%)"
    )


if __name__ == "__main__":
    main()
