"""Metrics helpers: one registry per process and a tiny ops server for stages without an API.

Names follow ``<component>_<what>_<unit>`` (``ingest_episodes_total``, ``trainer_step_seconds``).
Stages that are not HTTP services (ingest, reward, trainer) expose ``/metrics`` and ``/health``
through :func:`serve_ops`; serving mounts the same two routes on its FastAPI app.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

HealthFn = Callable[[], tuple[bool, dict[str, object]]]


def new_registry() -> CollectorRegistry:
    """A process's own registry (not the global default), so tests can run stages side by side."""
    return CollectorRegistry(auto_describe=True)


def serve_ops(registry: CollectorRegistry, health: HealthFn, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``/metrics`` and ``/health`` on a daemon thread; returns the server (``.server_port``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif self.path == "/health":
                ok, detail = health()
                body = json.dumps({"ok": ok, **detail}).encode()
                ctype, code = "application/json", 200 if ok else 503
            else:
                body, ctype, code = b'{"error": "not found"}', "application/json", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep scrapes out of the logs
            return

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="ops-http", daemon=True).start()
    return server
