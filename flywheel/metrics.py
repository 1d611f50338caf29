"""Metrics helpers: one registry per process and a tiny ops server for stages without an API.

Names follow ``<component>_<what>_<unit>`` (``ingest_episodes_total``, ``trainer_step_seconds``).
Stages that are not HTTP services (ingest, reward, trainer) expose ``/metrics``, ``/livez``,
``/readyz`` and ``/health`` through :func:`serve_ops` (flywheel/probes.py says what the probes
judge); serving and the release controller mount the same routes on their FastAPI apps.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter

from flywheel.probes import HealthFn, Probes

#: Every path :func:`serve_ops` answers (tests hold the manifests' probes to these).
OPS_PATHS = ("/metrics", "/livez", "/readyz", "/health")


def new_registry() -> CollectorRegistry:
    """A process's own registry (not the global default), so tests can run stages side by side."""
    return CollectorRegistry(auto_describe=True)


@dataclass(frozen=True)
class OpsLimits:
    """How the ops port holds against slow and greedy clients. Its clients (the kubelet's probes,
    Prometheus) send one small request at once and read a small answer, while a connection that
    sends its request a byte every few seconds would hold one of its threads for ever: enough of
    them and ``/livez`` is never answered, and the kubelet restarts a healthy stage. So a
    connection lives ``connection_s`` at most (request and answer: HTTP/1.0, one request each), an
    address holds ``per_client`` connections, and the process ``total``; one over a cap is closed
    at once, without a thread.

    Not settings, unlike ``[http]`` (flywheel/connections.py), whose clients are the product's and
    whose caps depend on its traffic and on a proxy in front: the ops port's clients are the same
    in every deployment (a probe with a 1 s timeout, a scrape of a few kB every 15 s, from a
    handful of addresses), so these bounds sit far from what they need anywhere and nobody has a
    reason to tune them. Cuts are counted as ``<component>_connections_cut_total{reason}`` under
    :data:`OPS_CUTS`, as the APIs' are."""

    connection_s: float = 5.0
    per_client: int = 16
    total: int = 128


#: Why the ops port closed a connection (the ``reason`` label): its deadline passed
#: (``connection_s``), its address held ``per_client``, the process held ``total``. The caps'
#: names are flywheel/connections.py's ``Cut`` values, so one alert reads both servers.
OPS_CUTS = ("connection_timeout", "client_cap", "process_cap")


class _OpsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: OpsLimits,
                 on_cut: Callable[[str], None]) -> None:
        self.limits = limits
        self.on_cut = on_cut
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._admitted: dict[int, str] = {}  # id(socket) -> its client's address
        super().__init__(address, handler)

    def open_connections(self) -> int:
        """Connections admitted and not yet closed."""
        with self._lock:
            return self._open.total()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        host = client_address[0]
        with self._lock:
            if self._open.total() >= self.limits.total:
                self.on_cut("process_cap")
                return False  # socketserver closes it
            if self._open[host] >= self.limits.per_client:
                self.on_cut("client_cap")
                return False
            self._open[host] += 1
            self._admitted[id(request)] = host
        return True

    def close_request(self, request: Any) -> None:
        with self._lock:
            host = self._admitted.pop(id(request), None)
            if host is not None:  # a refused one was never counted
                self._open[host] -= 1
                if self._open[host] <= 0:
                    del self._open[host]
        super().close_request(request)


def serve_ops(registry: CollectorRegistry, probes: Probes, host: str, port: int,
              limits: OpsLimits = OpsLimits(), *, component: str | None = None) -> ThreadingHTTPServer:
    """Serve :data:`OPS_PATHS` on a daemon thread; returns the server (``.server_port``).

    ``/livez`` and ``/readyz`` answer ``{"ok": ...}`` with what their check reports; ``/health``
    is ``/readyz``'s answer for people, under the same status code. Slow and greedy clients are
    held off by ``limits`` (:class:`OpsLimits`), and with ``component`` each connection closed
    for them is counted in ``<component>_connections_cut_total{reason}`` (:data:`OPS_CUTS`)."""
    checks: dict[str, HealthFn] = {"/livez": probes.live, "/readyz": probes.ready, "/health": probes.ready}
    on_cut: Callable[[str], None] = lambda reason: None
    if component is not None:
        cuts = PromCounter(f"{component}_connections_cut", "Ops-port connections closed for a slow or greedy "
                           "client, by reason (flywheel/metrics.py OpsLimits)", ["reason"], registry=registry)
        for reason in OPS_CUTS:
            cuts.labels(reason)  # every reason shows from the start, at 0
        on_cut = lambda reason: cuts.labels(reason).inc()

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            # one deadline for the whole connection, not a timeout per read: a byte every few
            # seconds passes any read timeout
            self._deadline = threading.Timer(limits.connection_s, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

        def _cut(self) -> None:
            on_cut("connection_timeout")
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

        def finish(self) -> None:
            self._deadline.cancel()
            try:
                super().finish()
            except OSError:
                pass  # the deadline shut the socket under a buffered write

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

    server = _OpsServer((host, port), Handler, limits, on_cut)
    threading.Thread(target=server.serve_forever, name="ops-http", daemon=True).start()
    return server
