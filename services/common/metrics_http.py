"""GET /metrics over HTTP: prometheus_client's server in a daemon thread, so scrapes never run
on (or wait for) a service's event loop."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

import services.common.metrics  # noqa: F401  (its exposition settings apply to every page)

log = logging.getLogger(__name__)


class MetricsServer:
    """Serves `registry` at /metrics on host:port (0 = any free port), from construction on."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd: WSGIServer
        self._thread: threading.Thread
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int | None, service: str
) -> MetricsServer | None:
    """A running MetricsServer, or None when metrics are off (`port` is None)."""
    if port is None:
        return None
    server = MetricsServer(registry, host, port)
    log.info("metrics listening", extra={"service": service, "url": server.url})
    return server
