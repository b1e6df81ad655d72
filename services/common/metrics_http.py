"""GET /metrics over HTTP: a stdlib server in a daemon thread, so scrapes never run on (or
wait for) a service's event loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.common.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)


class MetricsServer:
    """Serves `render()` at /metrics on host:port (0 = any free port)."""

    def __init__(self, render: Callable[[], str], host: str, port: int) -> None:
        self._render = render
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(render))
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="metrics-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, so only if it runs
            self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(
    render: Callable[[], str], host: str, port: int | None, service: str
) -> MetricsServer | None:
    """A running MetricsServer, or None when metrics are off (`port` is None)."""
    if port is None:
        return None
    server = MetricsServer(render, host, port).start()
    log.warning("metrics listening", extra={"service": service, "url": server.url})
    return server


def _handler_for(render: Callable[[], str]) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
                return
            try:
                body = render().encode("utf-8")
            except Exception:
                log.exception("rendering metrics failed")
                self._reply(500, "text/plain; charset=utf-8", b"rendering metrics failed\n")
                return
            self._reply(200, CONTENT_TYPE, body)

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape on stderr would drown the JSON logs

    return MetricsHandler
