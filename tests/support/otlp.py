"""An OTLP/HTTP trace receiver that keeps the spans it is sent: what a test's processes export
to, so that the test reads back the spans of processes it starts (and kills) itself. (The
bench's receiver, `agentruns.bench.otlp_sink`, keeps nothing: it measures the exporting side.)"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

MAX_REQUEST_BYTES = 16 << 20


@dataclass
class Received:
    url: str  # OTEL_EXPORTER_OTLP_ENDPOINT
    bodies: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def spans(self) -> list[dict[str, Any]]:
        """Every span received: name, ids (hex; ``parent`` None for a root), start (ns since
        the epoch) and attributes."""
        with self.lock:
            bodies = list(self.bodies)
        out: list[dict[str, Any]] = []
        for body in bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        attributes = {
                            a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                            for a in span.attributes
                        }
                        out.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex() or None,
                                "start_ns": span.start_time_unix_nano,
                                "attributes": attributes,
                            }
                        )
        return out


@contextmanager
def receiving(host: str = "127.0.0.1") -> Iterator[Received]:
    """Serves ``/v1/traces`` (OTLP/HTTP, protobuf) until the end of the block."""
    received: Received

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 <= size <= MAX_REQUEST_BYTES:
                self.send_error(413)
                return
            body = self.rfile.read(size)
            with received.lock:
                received.bodies.append(body)
            self.send_response(200)  # an empty ExportTraceServiceResponse: all accepted
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    received = Received(f"http://{host}:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()
