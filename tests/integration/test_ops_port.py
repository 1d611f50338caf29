"""The stages' ops port (flywheel/metrics.py serve_ops) against slow and greedy clients.

Its ``/livez`` is the kubelet's liveness probe: a client that keeps its threads busy would get a
healthy stage restarted. Every connection lives ``OpsLimits.connection_s`` at most, and an address
holds ``per_client`` of them; another address (127.0.0.2, the kubelet's here) is still answered.
Each connection closed so is counted in ``<component>_connections_cut_total{reason}``.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flywheel.connections import Cut
from flywheel.metrics import OPS_CUTS, OpsLimits, new_registry, serve_ops
from flywheel.probes import Probes


def _ok() -> tuple[bool, dict]:
    return True, {}


def _slow_sender(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed ``sock`` within ``seconds`` (EOF or a reset on read)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _livez_from(port: int, source: str) -> int:
    with socket.create_connection(("127.0.0.1", int(port)), timeout=5, source_address=(source, 0)) as sock:
        sock.sendall(b"GET /livez HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"ok": True}
    return status


class Ops(int):
    """The server's port, with its registry (``<component>_connections_cut_total``)."""

    registry: CollectorRegistry
    server: Any

    def admitted(self, n: int) -> None:
        """Wait until the server took in ``n`` connections: a client's connect returns once the
        kernel queued it, before the server's thread accepted and counted it."""
        deadline = time.monotonic() + 5
        while self.server.open_connections() < n:
            assert time.monotonic() < deadline, f"{self.server.open_connections()} of {n} connections admitted"
            time.sleep(0.02)

    def cuts(self, reason: str) -> float:
        return self.registry.get_sample_value("ingest_connections_cut_total", {"reason": reason})


def _serve(connection_s: float):
    registry = new_registry()
    server = serve_ops(registry, Probes(_ok, _ok), "127.0.0.1", 0,
                       OpsLimits(connection_s=connection_s, per_client=4, total=8), component="ingest")
    port = Ops(server.server_port)
    port.registry, port.server = registry, server
    return port


@pytest.fixture
def ops():
    """A deadline of 1 s, for the deadline's own test."""
    port = _serve(1.0)
    yield port
    port.server.shutdown()
    port.server.server_close()


@pytest.fixture
def ops_capped():
    """A deadline far past the test, so the caps are what close connections (on a loaded machine
    a 1 s deadline cut held connections before the cap was tried)."""
    port = _serve(30.0)
    yield port
    port.server.shutdown()
    port.server.server_close()


def test_every_cut_reason_is_exported_at_zero_and_the_caps_are_named_as_the_apis_are(ops):
    assert {reason: ops.cuts(reason) for reason in OPS_CUTS} == dict.fromkeys(OPS_CUTS, 0.0)
    assert {"client_cap", "process_cap"} <= {cut.value for cut in Cut}


def test_a_slow_request_is_cut_at_the_connection_deadline(ops):
    """Before: a request sent a byte at a time held its thread for ever (no timeout at all)."""
    sock = _slow_sender(ops)
    started = time.monotonic()
    try:
        assert _closed_within(sock, 4.0)
    finally:
        sock.close()
    assert time.monotonic() - started < 3.0
    assert ops.cuts("connection_timeout") == 1


def test_an_address_over_its_share_is_refused_and_livez_answers_another(ops_capped):
    """Four slow connections fill 127.0.0.1's share: its fifth is closed at once, while the
    kubelet's address is answered; once they are closed, 127.0.0.1 is answered again."""
    ops = ops_capped
    held = [_slow_sender(ops) for _ in range(4)]
    ops.admitted(4)
    try:
        extra = _slow_sender(ops)
        assert _closed_within(extra, 0.5), "an address over its share is closed at once"
        extra.close()
        assert ops.cuts("client_cap") == 1
        assert _livez_from(ops, "127.0.0.2") == 200
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # the closed ones are released as their threads end
        try:
            assert _livez_from(ops, "127.0.0.1") == 200
            break
        except (AssertionError, IndexError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_process_cap_closes_the_rest_and_the_server_goes_on(ops_capped):
    """Eight connections from two addresses fill the process: a ninth is closed at once; once
    they are closed every address is answered again. A plain urllib client reads /metrics."""
    ops = ops_capped
    held = [_slow_sender(ops) for _ in range(4)]
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", int(ops)), timeout=5, source_address=("127.0.0.3", 0))
        sock.sendall(b"GET /")
        held.append(sock)
    ops.admitted(8)
    try:
        with pytest.raises((OSError, IndexError)):
            _livez_from(ops, "127.0.0.2")
        assert ops.cuts("process_cap") == 1
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while ops.server.open_connections():  # released as their threads see the close
        assert time.monotonic() < deadline, "closed connections were never released"
        time.sleep(0.05)
    assert _livez_from(ops, "127.0.0.2") == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=5) as resp:
        assert resp.status == 200
