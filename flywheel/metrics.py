"""Metrics helpers: one registry per process and a tiny ops server for stages without an API.

Names follow ``<component>_<what>_<unit>`` (``ingest_episodes_total``, ``trainer_step_seconds``).
Stages that are not HTTP services (ingest, reward, trainer) expose ``/metrics``, ``/livez``,
``/readyz`` and ``/health`` through :func:`serve_ops` (flywheel/probes.py says what the probes
judge); serving and the release controller mount the same routes on their FastAPI apps.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flywheel.probes import HealthFn, Probes

#: Every path :func:`serve_ops` answers (tests hold the manifests' probes to these).
OPS_PATHS = ("/metrics", "/livez", "/readyz", "/health")


def new_registry() -> CollectorRegistry:
    """A process's own registry (not the global default), so tests can run stages side by side."""
    return CollectorRegistry(auto_describe=True)


def serve_ops(registry: CollectorRegistry, probes: Probes, host: str, port: int) -> ThreadingHTTPServer:
    """Serve :data:`OPS_PATHS` on a daemon thread; returns the server (``.server_port``).

    ``/livez`` and ``/readyz`` answer ``{"ok": ...}`` with what their check reports; ``/health``
    is ``/readyz``'s answer for people, under the same status code."""
    checks: dict[str, HealthFn] = {"/livez": probes.live, "/readyz": probes.ready, "/health": probes.ready}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif self.path in checks:
                ok, detail = checks[self.path]()
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
