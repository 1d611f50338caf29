"""Serving's app on the session's vLLM engine behind the connection guard (flywheel/connections.py;
the guard's own rules are tested against the release API in test_connections.py): a key holder's
body that trickles is cut with 408 and counted as one, and a generation streamed for longer than
every timeout runs to its end."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from flywheel.settings import HttpSettings

pytestmark = pytest.mark.integration


def test_serving_cuts_a_slow_body_with_408_and_streams_past_every_timeout(serve):
    # the real app on the session's engine: a key holder's body that trickles is cut and counted
    # as a 408 (no 500, no traceback), while a streamed generation longer than every timeout runs
    # to its last token
    from serving_helpers import KEY

    served = serve(http=HttpSettings(header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_s=0.3))
    port = int(served.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
              "application/json\r\nContent-Length: 60\r\n\r\n{\"model\": \"flywheel\"".encode())
    assert s.makefile("rb").read().startswith(b"HTTP/1.1 408 ")  # read to the close
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'serving_connections_cut_total{reason="body_timeout"} 1.0' in metrics
    deadline = time.monotonic() + 5
    while 'route="/v1/completions",status="408"' not in metrics:
        assert time.monotonic() < deadline, "the cut request was not counted as a 408"
        time.sleep(0.05)
        metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'status="500"' not in metrics
    start = time.monotonic()
    body = {"model": "flywheel", "prompt": "a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    print(f"stream of 200 tokens took {time.monotonic() - start:.2f} s")
    assert lines[-1] == "data: [DONE]" and len(lines) > 100
    assert 'reason="header_timeout"} 0.0' in httpx.get(served.url + "/metrics", timeout=10).text
