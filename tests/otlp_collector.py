"""A minimal OTLP/HTTP trace collector on 127.0.0.1 for tests: it decodes what other
processes export (the protobuf of ``/v1/traces``) into plain span records."""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    service: str
    attributes: dict


class Collector:
    """``with Collector() as collector``: ``collector.endpoint`` takes OTLP/HTTP posts;
    ``spans()`` are what arrived so far, and ``paths`` where they were posted."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._bodies: list[bytes] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.paths.append(self.path)
                owner._bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Collector:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[Span]:
        found = []
        for body in list(self._bodies):
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = next(
                    (a.value.string_value for a in resource.resource.attributes
                     if a.key == "service.name"), "",
                )  # fmt: skip
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        attributes = {a.key: _value(a.value) for a in s.attributes}
                        found.append(
                            Span(s.name, s.trace_id.hex(), s.span_id.hex(),
                                 s.parent_span_id.hex(), service, attributes)
                        )  # fmt: skip
        return found


def _value(value) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
