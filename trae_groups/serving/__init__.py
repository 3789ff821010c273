"""The HTTP front: one Starlette app serves every graph (``server``) through the graph
routes (``graph_api``) and the OpenAI-compatible ones (``openai_api``;
``openai_structured`` and ``tool_parsers`` for structured output and tool calls,
``openai_responses`` for /v1/responses, ``openai_tokenize`` for /tokenize and /detokenize,
``model_files`` for what the front reads of a model's folder), each request inside one ``RunScope`` (``run_scope``: admission,
deadline admission, its outcome, its release). What they share lives in ``app_state``;
``admission``, ``metrics``, ``http_io``, ``http_errors``, ``http_protocol`` and
``openapi`` are their parts. docs/serving.md is the guide.

``create_app``, ``serve``, ``ServerConfig`` and ``ServerThread`` are here too, loaded on
first use (as from ``trae_groups``), so importing this package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = ("create_app", "serve", "ServerConfig", "ServerThread")

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module("trae_groups.serving.server"), name)
    raise AttributeError(f"module 'trae_groups.serving' has no attribute {name!r}")
