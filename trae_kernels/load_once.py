"""A native library loaded on first use, once per process, for the ctypes kernels here."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("trae_groups.kernels")


class LoadOnce:
    """``get()``: what ``load()`` returned, or None where it raised one of ``errors`` (the
    reason logged once, after ``instead``: what runs without it). Threads that ask while
    it loads wait for the one load."""

    def __init__(
        self, load: Callable[[], ctypes.CDLL], errors: tuple[type[Exception], ...], instead: str
    ) -> None:
        self._load, self._errors, self._instead = load, errors, instead
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    self._lib = self._load()
                except self._errors as exc:
                    log.info("%s: %s", self._instead, exc)
                self._tried = True
        return self._lib
