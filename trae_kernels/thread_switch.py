"""A per-thread off switch for an optional kernel: tests run the torch reference beside it in
the same process, on the same inputs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ThreadSwitch:
    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def off(self) -> bool:
        """Whether this thread asked for the reference (inside ``turned_off``)."""
        return getattr(self._local, "off", False)

    @contextlib.contextmanager
    def turned_off(self) -> Iterator[None]:
        """Run the reference on this thread meanwhile."""
        self._local.off = True
        try:
            yield
        finally:
            self._local.off = False
