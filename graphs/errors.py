"""Graph errors: one hierarchy, so the server maps each kind to one HTTP status.

Validation errors carry every issue found at once (file, line, node), because a
user fixing a graph file wants the whole list, not one error per attempt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class GraphError(Exception):
    """Base of every error the graph layer raises."""


@dataclass(frozen=True)
class ValidationIssue:
    """One problem in a graph declaration, located as precisely as we can."""

    file: str
    line: int | None
    node: str | None
    message: str
    column: int | None = None

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        who = f"node '{self.node}': " if self.node else ""
        return f"{where}: {who}{self.message}"


@dataclass(frozen=True)
class Location:
    """Where a key sits; `value_line`/`literal` place template lines inside its value.

    `file` overrides the source map's file (DSL calls made from another module).
    """

    line: int
    column: int | None = None
    value_line: int | None = None
    literal: bool = False
    file: str | None = None


@dataclass
class SourceMap:
    """Maps a spec path such as ("nodes", "reply", "prompt") to its place in a file."""

    file: str
    locations: dict[tuple, Location] = field(default_factory=dict)
    base_dir: Path | None = None

    def locate(self, path: tuple) -> Location | None:
        """The deepest known location along `path`; unknown steps (union tags) skipped."""
        best, prefix = self.locations.get(()), ()
        for step in path:
            candidate = (*prefix, step)
            if candidate in self.locations:
                prefix, best = candidate, self.locations[candidate]
        return best

    def issue(
        self,
        path: tuple,
        message: str,
        node: str | None = None,
        template_line: int | None = None,
    ) -> ValidationIssue:
        loc = self.locate(path)
        if loc is None:
            return ValidationIssue(self.file, None, node, message)
        line, column = loc.line, loc.column
        if template_line and loc.value_line is not None:
            line = loc.value_line + (template_line if loc.literal else 0)
            column = None
        return ValidationIssue(loc.file or self.file, line, node, message, column)


class GraphValidationError(GraphError, ValueError):
    """A graph was rejected at load time; ``issues`` lists every problem found."""

    def __init__(self, issues: Iterable[ValidationIssue]):
        self.issues: list[ValidationIssue] = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))

    def __str__(self) -> str:
        return "\n".join(str(issue) for issue in self.issues)


class TemplateRenderError(GraphError):
    """A template or condition failed at run time (missing field, sandbox refusal)."""


class NodeError(GraphError):
    """A node failed; the request fails with the node's name and the cause."""

    def __init__(self, node: str, cause: BaseException | str):
        self.node = node
        self.cause = cause
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"node '{node}' failed: {detail}")


class GraphTimeout(GraphError, TimeoutError):
    """A node's (``node`` set) or the whole graph's (``node`` None) time ran out."""

    def __init__(
        self, node: str | None, timeout: float | None = None, dropped: tuple[str, ...] = ()
    ):
        self.node = node
        self.timeout = timeout
        self.dropped = dropped  # the graph's: nodes unfinished when its time ran out
        what = f"node '{node}'" if node else "graph"
        after = f" after {timeout:g}s" if timeout is not None else ""
        super().__init__(f"{what} timed out{after}")


def first_error(exc: Any) -> tuple[str | None, str]:
    """(where, message) of a pydantic ValidationError's first error: the one way the
    request path turns pydantic's errors into a 422 that names the field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or None
    return where, first["msg"]
