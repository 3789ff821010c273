"""Which functions a `python` node may name: one policy, read from one place.

A graph file names a function by import path (``package.module:attr.path``) and the
server calls it with arguments that requests control, so ``os:system`` in a graph
would run shell commands. The policy:

- **denied** by default: modules that run commands, touch files, sockets or
  processes, or load code (``os``, ``subprocess``, ``builtins``, ``sys``, ``shutil``,
  ``importlib``, ``pickle``, ``socket``, ``ctypes``, ... see ``DENIED_MODULES``);
- **allowed**, when the operator sets ``TRAE_ALLOWED_FUNCTIONS`` (or ``trae serve /
  run / validate --allow-functions``, which sets it): a comma-separated list of
  module prefixes; then only functions in those modules are accepted, and a prefix
  listed there is allowed even if the deny list names it.

The deny list is a net for the obvious, not a sandbox: any function the server may
import runs with the server's rights. A deployment that accepts graphs it did not
write sets the allow list.

Checked twice: from the text of the reference while a graph is validated (no import,
so ``trae validate`` reports it with file and line), and on the imported objects
(every module passed through on the way, and the module the function comes from),
so ``logging:os.system`` is refused too.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENV_VAR = "TRAE_ALLOWED_FUNCTIONS"

DENIED_MODULES: tuple[str, ...] = (
    # processes, shells, signals
    "os", "posix", "nt", "subprocess", "_posixsubprocess", "pty", "signal",
    "multiprocessing", "concurrent", "threading", "_thread", "asyncio",
    # the interpreter, imports and code
    "builtins", "sys", "importlib", "runpy", "code", "codeop", "pdb", "inspect",
    "types", "gc", "ctypes", "_ctypes", "cffi", "pickle", "_pickle", "marshal",
    "shelve", "dill", "cloudpickle", "joblib",
    # files
    "io", "_io", "codecs", "shutil", "pathlib", "tempfile", "glob", "fileinput",
    "zipfile", "tarfile", "zipimport", "sqlite3", "dbm",
    # network
    "socket", "_socket", "ssl", "http", "urllib", "ftplib", "smtplib", "telnetlib",
    "xmlrpc", "webbrowser", "requests", "httpx",
    # libraries that load pickles or write files
    "torch", "numpy", "pandas",
    # the server itself
    "trae_groups",
)  # fmt: skip


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class FunctionPolicy:
    """``allowed`` None: any module the deny list does not name."""

    allowed: tuple[str, ...] | None = None
    denied: tuple[str, ...] = DENIED_MODULES

    @classmethod
    def from_env(cls) -> FunctionPolicy:
        return cls(allowed=parse_prefixes(os.environ.get(ENV_VAR)))

    def module_problem(self, module: str) -> str | None:
        """Why functions from ``module`` may not be named, or None."""
        if self.allowed is not None:
            if _within(module, self.allowed):
                return None
            return f"module '{module}' is not in {ENV_VAR} ({', '.join(self.allowed)})"
        if _within(module, self.denied):
            return (
                f"module '{module}' is not allowed in graphs (it can run commands, touch "
                f"files or load code); an operator can allow it with {ENV_VAR}"
            )
        return None

    def reference_problem(self, reference: str) -> str | None:
        """Checked on the text alone: the module, and no dunder on the way."""
        module, _, attr_path = reference.partition(":")
        problem = self.module_problem(module)
        if problem:
            return f"'{reference}': {problem}"
        if any(part.startswith("__") for part in attr_path.split(".")):
            return f"'{reference}': names starting with '__' are not allowed"
        return None

    def object_problem(self, reference: str, obj: Any) -> str | None:
        """Checked on what the import found: a module passed through, or the module
        the function itself comes from (only the deny list: re-exports are fine)."""
        if isinstance(obj, types.ModuleType):
            problem = self.module_problem(obj.__name__)
        else:
            home = getattr(obj, "__module__", None)
            denied = (
                isinstance(home, str)
                and _within(home, self.denied)
                and not _within(home, self.allowed or ())
            )
            problem = f"it comes from module '{home}'" if denied else None
        return f"'{reference}': {problem}" if problem else None


def parse_prefixes(text: str | None) -> tuple[str, ...] | None:
    """``"myapp, tools.nlp"`` -> ("myapp", "tools.nlp"); unset or blank -> None."""
    if text is None or not text.strip():
        return None
    return tuple(p for p in (part.strip() for part in text.replace(",", " ").split()) if p)
