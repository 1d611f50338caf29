"""Slow and greedy clients against the release API over real sockets on loopback
(flywheel/connections.py): a request's headers or body sent slowly is cut with 408, a head too
large with 431, an address over its connection cap is refused with 429 while another address is
still served, and nothing after the request (a response, a stream) is ever timed.

The release API runs on a real SQLite file with its own uvicorn server (release/main.py); serving's
app on the session's vLLM engine is checked in test_serving_connections.py, beside the other tests
that share the engine. Timeouts here are a fraction of a second so that each test takes about one;
the defaults and the measured figures are in docs/serving-api.md.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from flywheel.connections import Cut, refusal
from flywheel.metrics import new_registry
from flywheel.settings import HttpSettings, ReleaseSettings

pytestmark = pytest.mark.integration

APPROVER = "tok-approver"
#: A cut must come within this much of its timeout (it is armed on the loop; the margin is for a
#: loaded 2-core machine, not a speed target).
SLACK_S = 3.0


@contextmanager
def release_api(tmp_path, **limits) -> Iterator[object]:
    from release.api import make_app
    from release.main import ApiServer
    from release.store import ReleaseStore

    store = ReleaseStore(f"sqlite:///{tmp_path / 'release.sqlite3'}")
    registry = new_registry()
    app = make_app(store, ReleaseSettings(tokens=(f"abe:approver:{APPROVER}",)), registry=registry)
    api = ApiServer(app, "127.0.0.1", 0, HttpSettings(**limits), registry).start()
    api.registry = registry
    try:
        yield api
    finally:
        api.stop()
        store.close()


def dial(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))  # 127.0.0.2 is a second loopback address: another client as the server sees it
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def answer(s: socket.socket) -> bytes:
    """What the server sent until it closed the connection (b"" when it closed without a word)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def health(port: int, source: str = "127.0.0.2") -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=5) as client:
        return client.get(f"http://127.0.0.1:{port}/health").status_code


def metric(api, name: str, **labels: str) -> float:
    return api.registry.get_sample_value(name, labels) or 0.0


def test_headers_sent_a_byte_at_a_time_are_cut_with_408(tmp_path):
    with release_api(tmp_path, header_timeout_s=1.0) as api:
        s = dial(api.port)
        start = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        cut_at = None
        for byte in request:  # a byte every 0.2 s: 20 s to finish, far past the timeout
            try:
                s.sendall(bytes([byte]))
            except OSError:
                cut_at = time.monotonic()
                break
            s.settimeout(0.2)
            try:
                if got := s.recv(65536):
                    cut_at = time.monotonic()
                    assert got.startswith(b"HTTP/1.1 408 "), got
                    break
            except TimeoutError:
                continue
        assert cut_at is not None, "the slow header sender was never cut"
        assert cut_at - start < 1.0 + SLACK_S
        assert metric(api, "release_connections_cut_total", reason="header_timeout") == 1


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(tmp_path):
    with release_api(tmp_path, header_timeout_s=0.5) as api:
        s = dial(api.port)
        start = time.monotonic()
        assert answer(s) == b""
        assert time.monotonic() - start < 0.5 + SLACK_S


def test_a_kept_alive_connections_next_request_is_timed_too(tmp_path):
    # uvicorn's keep-alive timer stops at the next request's first byte; the header deadline
    # must start there, or a client makes one quick request and then trickles the next
    with release_api(tmp_path, header_timeout_s=0.5, keep_alive_s=30) as api:
        s = dial(api.port)
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        time.sleep(0.8)  # idle past the header timeout: keep-alive's business, not the guard's
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /livez HTTP/1.1\r\n")
        assert answer(s).startswith(b"HTTP/1.1 408 ")


def test_a_head_past_its_cap_is_refused_with_431_at_once(tmp_path):
    # the parser keeps a head whole until it ends: without a cap a fast client fills the memory
    # before the header timeout (86 MB of one header in 10 s, measured on loopback)
    with release_api(tmp_path, max_head_bytes=64 * 1024, header_timeout_s=30) as api:
        s = dial(api.port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(64):  # 4 MB at most, in 64 kB pieces, until the server answers
            s.sendall(b"a" * 65536)
            if select.select([s], [], [], 0.2)[0]:
                break  # stop sending: more bytes after its close would make it reset the connection
        got = answer(s)
        assert got.startswith(b"HTTP/1.1 431 "), got[:200]
        assert metric(api, "release_connections_cut_total", reason="head_too_large") == 1
        # a request with a head under the cap and a body in the same packets is served
        r = httpx.post(f"http://127.0.0.1:{api.port}/api/rollback", content=b"x" * 200_000,
                       headers={"Authorization": f"Bearer {APPROVER}", "X-Pad": "p" * 8000}, timeout=10)
        assert r.status_code == 413


def test_a_slow_body_is_cut_with_408_and_counted_as_one_not_a_500(tmp_path):
    with release_api(tmp_path, body_timeout_s=0.5) as api:
        s = dial(api.port)
        s.sendall(b"POST /api/rollback HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + APPROVER.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"reas")
        start = time.monotonic()
        got = answer(s)
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert time.monotonic() - start < 0.5 + SLACK_S
        assert metric(api, "release_connections_cut_total", reason="body_timeout") == 1
        # the app saw the client go away: it counted a 408 (the caller's doing), never a 500
        deadline = time.monotonic() + 5
        while not metric(api, "release_api_requests_total", route="/api/rollback", method="POST", status="408"):
            assert time.monotonic() < deadline, "the cut request was not counted as a 408"
            time.sleep(0.05)
        assert not metric(api, "release_api_requests_total", route="/api/rollback", method="POST", status="500")


def test_an_address_over_its_cap_is_refused_while_another_is_served(tmp_path):
    with release_api(tmp_path, max_connections_per_client=8, header_timeout_s=30) as api:
        held = [dial(api.port) for _ in range(8)]
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # half a request each, holding the connection
        extra = dial(api.port)
        try:
            got = answer(extra)
        except ConnectionResetError:  # refused before its request was read: a reset is a refusal too
            got = b"reset"
        assert got.startswith(b"HTTP/1.1 429 ") or got == b"reset", got
        assert health(api.port, source="127.0.0.2") == 200
        assert api.guard.open_by_client["127.0.0.1"] == 8
        assert metric(api, "release_connections_cut_total", reason="client_cap") == 1
        for s in held:
            s.close()


def test_the_process_cap_refuses_everyone_with_503(tmp_path):
    with release_api(tmp_path, max_connections=4, max_connections_per_client=0, header_timeout_s=30) as api:
        held = [dial(api.port, source) for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")]
        try:
            got = answer(dial(api.port, "127.0.0.5"))
        except ConnectionResetError:
            got = b"reset"
        assert got.startswith(b"HTTP/1.1 503 ") or got == b"reset", got
        held[0].close()
        deadline = time.monotonic() + 5
        while api.guard.open_total > 3:  # the server sees the close on its next loop turn
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert health(api.port, source="127.0.0.5") == 200


def test_health_answers_while_one_address_holds_hundreds_of_slow_connections(tmp_path):
    # the finding: 300 slow connections took /health away (a process allowed 256 files; the slow
    # suite's test_slow_clients starts the real processes so). Here one address trickles 300 (its
    # cap is 64) and another asks for /health every 0.1 s meanwhile
    with release_api(tmp_path, max_connections_per_client=64, header_timeout_s=30) as api:
        attackers = []
        for _ in range(300):
            try:
                s = dial(api.port)
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
                attackers.append(s)
            except OSError:
                pass  # refused or reset: what the cap does
        codes = []
        for _ in range(10):
            codes.append(health(api.port))
            time.sleep(0.1)
        assert codes == [200] * 10
        # seen from the attacker: all but 64 of its connections were refused (429, or closed)
        refused = 300 - len(attackers)
        for s in attackers:
            if select.select([s], [], [], 0)[0]:  # the server spoke or closed: no slow request is read on it
                refused += 1
        assert refused >= 300 - 64
        assert api.guard.open_by_client["127.0.0.1"] <= 64
        for s in attackers:
            s.close()


def test_a_stream_longer_than_every_timeout_is_not_cut():
    # only reading the request is timed: a response that takes longer (a stream, a long
    # generation) runs to its end
    from serving.server import AppServer, LoopThread

    app = FastAPI()

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def ticks():
            for i in range(12):
                await asyncio.sleep(0.1)
                yield f"data: {i}\n\n"
        return StreamingResponse(ticks(), media_type="text/event-stream")

    loop = LoopThread("test-connections")
    limits = HttpSettings(header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_s=0.3)
    server = AppServer(app, loop, limits=limits).start()
    try:
        with httpx.Client(timeout=10) as client:
            r = client.post(server.url + "/stream", json={"x": 1})
            assert r.status_code == 200
            assert r.text.count("data: ") == 12  # 1.2 s, four times each timeout
        assert not server.guard.cuts
    finally:
        server.stop()
        loop.stop()



def test_a_pipelined_request_behind_a_stream_is_timed_from_its_turn():
    # uvicorn queues a request pipelined behind a response and stops reading: its body cannot come
    # until the stream ends, so a body deadline armed at its headers wrote a 408 into the stream
    from serving.server import AppServer, LoopThread

    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def ticks():
            for i in range(10):
                await asyncio.sleep(0.1)
                yield f"data: {i}\n\n"
        return StreamingResponse(ticks(), media_type="text/event-stream")

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body())

    loop = LoopThread("test-connections")
    server = AppServer(app, loop, limits=HttpSettings(header_timeout_s=5, body_timeout_s=0.3)).start()
    try:
        s = dial(server.port)
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        got = s.recv(65536)
        while b"data: 0" not in got:
            got += s.recv(65536)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")  # its body after the stream
        while b"\r\n0\r\n\r\n" not in got:  # the stream's last chunk (1 s: three body timeouts)
            chunk = s.recv(65536)
            assert chunk, f"closed mid-stream: {got[-300:]!r}"
            got += chunk
        assert b" 408 " not in got and got.count(b"data: ") == 10
        s.sendall(b"hello")
        echoed = s.recv(65536)
        assert echoed.startswith(b"HTTP/1.1 200 ") and echoed.endswith(b"hello"), echoed
        assert not server.guard.cuts
        # once its turn comes, its body deadline holds it as any other's
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe")
        got = answer(s)
        assert got.count(b"data: ") == 10 and got.endswith(b"\r\n0\r\n\r\n" + refusal(Cut.BODY_TIMEOUT)), got[-400:]
        assert server.guard.cuts == {Cut.BODY_TIMEOUT: 1}
    finally:
        server.stop()
        loop.stop()
