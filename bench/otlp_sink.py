"""An OTLP/HTTP trace receiver that keeps nothing: what `agentruns bench loop --tracing` exports
to, so that the benchmark measures what tracing costs the pipeline's processes (making,
batching, encoding and sending spans) and nothing of a trace store. It counts the requests and
bytes it was sent, to show that spans did arrive."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

#: A larger export request is read no further (the exporter's batches are far smaller).
MAX_REQUEST_BYTES = 64 << 20


class OtlpSink:
    """`with OtlpSink() as sink:` serves `sink.url` (OTEL_EXPORTER_OTLP_ENDPOINT) until the end
    of the block."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 <= size <= MAX_REQUEST_BYTES:
                    self.send_error(413)
                    return
                self.rfile.read(size)
                with sink._lock:
                    sink.requests += 1
                    sink.bytes += size
                # an empty ExportTraceServiceResponse: everything accepted
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-sink", daemon=True
        )

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"export_requests": self.requests, "export_bytes": self.bytes}

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
