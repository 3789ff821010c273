"""More HTTP front processes on one engine process: ``trae serve --api-workers N``.

For hosts where the HTTP and graph work, not the engine, is the bottleneck. The
``trae serve`` process is front 0: it binds the port, starts the engine process
(which also listens on a Unix socket in a private folder) and N-1 worker fronts
(``python -m trae_groups.serving.api_workers FD``), which accept on the same
listening socket and attach to that engine (``EngineProcessRuntime(attach=...)``).

Each front has its own executor, routes and metrics registry; the models, the pool
and the scheduler are the engine's, shared. Admin changes (a split, a version, a
reload) would reach one front only, so they are refused (409) with more than one.

Life cycle: a signal to ``trae serve`` is passed on to the workers; the engine stops
once every front has drained. A worker whose parent dies (its stdin closes) drains
and exits; a worker that does not exit in time is killed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("trae_groups.server")

#: After the grace, how long a worker front has to exit before it is killed.
EXIT_MARGIN_S = 15.0


class Workers:
    """The worker fronts of one ``trae serve`` and the engine socket they attach to."""

    def __init__(self, count: int, grace_s: float):
        self.count = count
        self.grace_s = grace_s
        self.folder = tempfile.mkdtemp(prefix="trae-engine-")  # 0700: only this user
        self.path = str(Path(self.folder) / "engine.sock")
        self.procs: list[subprocess.Popen] = []
        self._signalled = False
        self._lock = threading.Lock()

    def runtime(self, specs: list, engine: Any) -> Any:
        """Front 0's runtime: the engine process, listening for the workers; it stops
        only after they have."""
        from trae_groups.engine_process import EngineProcessRuntime

        runtime = EngineProcessRuntime.for_specs(specs, engine, listen=self.path)
        runtime.before_shutdown = self.stop
        return runtime

    def start(self, sock: socket.socket, graphs: Sequence[Any], config: Any) -> None:
        config = dataclasses.replace(config, memory_profile=None)  # front 0 samples it
        plan = pickle.dumps((list(graphs), config, self.path), protocol=5)
        for _ in range(self.count - 1):
            proc = subprocess.Popen(
                [sys.executable, "-m", "trae_groups.serving.api_workers", str(sock.fileno())],
                pass_fds=[sock.fileno()], stdin=subprocess.PIPE,
            )  # fmt: skip
            proc.stdin.write(plan)
            proc.stdin.flush()  # stdin stays open: its end is how the worker knows we live
            self.procs.append(proc)
        log.info("%d API worker process(es): %s", len(self.procs), [p.pid for p in self.procs])

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Pass the first shutdown signal on (they drain as this front does)."""
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def stop(self) -> None:
        """Every worker drained and gone (killed past the grace), then the socket folder."""
        self.signal()
        for proc in self.procs:
            try:
                proc.wait(self.grace_s + EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                log.warning("API worker %d did not exit: killing it", proc.pid)
                proc.kill()
                proc.wait(EXIT_MARGIN_S)
            if proc.stdin is not None:
                proc.stdin.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _watch_parent(grace_s: float) -> None:
    """stdin closes when the parent dies: drain as on SIGTERM, exit whatever happens."""
    sys.stdin.buffer.read()
    log.warning("API worker %d: trae serve went away; stopping", os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(grace_s + EXIT_MARGIN_S, os._exit, args=(1,)).start()


def main(argv: list[str]) -> int:
    """A worker front: the parent's graphs and config from stdin, its socket as argv[1]."""
    graphs, config, path = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[api %(process)d]: %(message)s",
    )
    from trae_groups.engine_process import EngineProcessRuntime
    from trae_groups.serving.server import TraeServer, _uvicorn_config, create_app

    def attached(specs: list, engine: Any) -> EngineProcessRuntime:
        return EngineProcessRuntime.for_specs(specs, engine, attach=path)

    app = create_app(graphs, config, runtime=attached)
    sock = socket.socket(fileno=int(argv[1]))
    state = app.state.trae
    server = TraeServer(_uvicorn_config(app, config), state)
    state.on_load_failed = server.stop
    threading.Thread(target=_watch_parent, args=(config.shutdown_grace_s,), daemon=True).start()
    server.run(sockets=[sock])
    return 1 if state.load_error else 0


if __name__ == "__main__":
    code = main(sys.argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the stdin watcher still blocks in a read: do not wait on it
