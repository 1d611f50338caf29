"""A real slow-loris tool, Debian's ``slowhttptest``, against the real processes: ``flywheel release
serve`` and ``flywheel serve`` (one vLLM engine), each started with only 256 open files allowed
(the limit under which 300 slow connections used to take ``/health`` away).

Each attack (slow headers, then a slow body) runs from 127.0.0.1 while this test asks for
``/health`` from 127.0.0.2 (another client, a new connection each time) every 0.2 s and sends one
more slow request from 127.0.0.3. It asserts that every ``/health`` is answered 200, that the
server never holds more than the attacker's cap, and that the slow request is held until its
timeout and then cut, and prints the figures docs/serving-api.md quotes (connections held, time to
the cut, ``/health`` latency):

    .venv/bin/python -m pytest tests/integration/test_slow_clients.py -s -q

Slow (about 3.5 minutes: two attacks of 11 and 31 s per process, and an engine's start): it runs with
``make test-slow``.
"""

from __future__ import annotations

import csv
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("slowhttptest") is None, reason="needs Debian's slowhttptest")]

#: The attack: slowhttptest's connections, opened at RATE a second, each sending a little more every
#: INTERVAL_S, for SECONDS.
CONNECTIONS, RATE, INTERVAL_S, SECONDS = 1000, 200, 5, 60
#: The defaults the figures are for (flywheel/settings.py, HttpSettings).
CAP_PER_CLIENT, HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 256, 10.0, 30.0
FILES = 256  # the open-file soft limit each process starts with: it raises it itself


@dataclass(frozen=True)
class Siege:
    """What one attack did: slowhttptest's own count, the server's, and what another client saw."""

    mode: str
    attacker_connected: int
    """The most connections slowhttptest counted as open at once (its CSV): a connection counts
    from its handshake, so a refused one counts until the refusal reaches it."""
    server_open: int
    """The most connections the server held at once (``<component>_connections_open``)."""
    cut_s: float
    """How long one more slow request, from 127.0.0.3 during the attack, was held."""
    cut_answer: bytes
    """What that request was answered before its connection closed."""
    health_codes: list[int]
    health_ms: list[float]

    def line(self, target: str) -> str:
        ms = sorted(self.health_ms)
        answers = ", ".join(line.decode() for line in self.cut_answer.split(b"\r\n") if line.startswith(b"HTTP/"))
        return (f"{target} {self.mode}: slowhttptest held at most {self.attacker_connected} connections (server: "
                f"{self.server_open}); a slow request cut after {self.cut_s:.1f} s ({answers or 'no answer'}); "
                f"/health {len(ms)} probes, all "
                f"{sorted(set(self.health_codes))}, median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms")


#: What each process logs at start: it raised its soft open-file limit from FILES to the hard one.
RAISED_TO_HARD = f"open-file limit {resource.getrlimit(resource.RLIMIT_NOFILE)[1]} (was {FILES},"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict[str, str], url: str, ready_s: float, log: Path) -> subprocess.Popen:
    # the log goes to a file: a pipe nobody reads during the attack fills, and the process's next
    # log line then blocks its event loop (what this test would measure instead of the attack)
    with open(log, "w") as out:  # started with the soft open-file limit a small container gives
        proc = subprocess.Popen(["prlimit", f"--nofile={FILES}:", sys.executable, "-m", "cli", *argv],
                                env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + ready_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{argv} did not become ready"
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def siege(url: str, path: str, mode: str, component: str, out: Path) -> Siege:
    """slowhttptest against ``url + path`` (``-H`` slow headers, ``-B`` slow body) while /health
    and /metrics are asked from 127.0.0.2, and one more slow request is timed from 127.0.0.3."""
    codes: list[int] = []
    latencies: list[float] = []
    server_open = [0]
    cut_s = [float("nan")]
    cut_answer = [b""]
    done = threading.Event()
    gauge = re.compile(rf"^{component}_connections_open (\S+)$", re.MULTILINE)

    def probe() -> None:
        # a new connection each time, as a kubelet's probe makes: one kept alive from before the
        # attack would not see a process that can no longer accept
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=5,
                          headers={"Connection": "close"}) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    codes.append(client.get(url + "/health").status_code)
                except httpx.HTTPError:
                    codes.append(0)  # no answer within 5 s, or refused
                latencies.append((time.perf_counter() - t0) * 1000)
                try:
                    if found := gauge.search(client.get(url + "/metrics").text):
                        server_open[0] = max(server_open[0], int(float(found.group(1))))
                except httpx.HTTPError:
                    pass
                done.wait(0.2)

    def one_slow_request() -> None:
        time.sleep(3)  # once the attack is on
        host, port = url.removeprefix("http://").split(":")
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n".encode()
        pieces = [head, *[b"X-a: b\r\n"] * 100] if mode == "-H" else [head + b"\r\n", *[b"a"] * 4096]
        with socket.create_connection((host, int(port)), source_address=("127.0.0.3", 0)) as s:
            s.settimeout(1)  # a piece a second
            t0 = time.monotonic()
            for piece in pieces:
                try:
                    s.sendall(piece)
                    while got := s.recv(65536):  # an answer (the 408; a 401 before the body) comes before the close
                        cut_answer[0] += got
                    break  # closed: cut
                except TimeoutError:
                    continue
                except OSError:
                    break
            cut_s[0] = time.monotonic() - t0

    threads = [threading.Thread(target=probe, daemon=True), threading.Thread(target=one_slow_request, daemon=True)]
    for t in threads:
        t.start()
    prefix = out / f"slow{mode}"
    subprocess.run(["slowhttptest", mode, "-c", str(CONNECTIONS), "-r", str(RATE), "-i", str(INTERVAL_S),
                    "-l", str(SECONDS), "-x", "24", "-p", "3", "-g", "-o", str(prefix), "-u", url + path],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=SECONDS + 60, check=False)
    threads[1].join(timeout=60)
    done.set()
    threads[0].join()
    with open(f"{prefix}.csv") as f:
        connected = max(int(row["Connected"]) for row in csv.DictReader(f))
    return Siege(mode, connected, server_open[0], cut_s[0], cut_answer[0], codes, latencies)


def hold_and_check(url: str, path: str, component: str, out: Path, target: str) -> None:
    for mode, timeout_s in (("-H", HEADER_TIMEOUT_S), ("-B", BODY_TIMEOUT_S)):
        s = siege(url, path, mode, component, out)
        print(s.line(target))
        assert s.health_codes and set(s.health_codes) == {200}, s.line(target)
        # the attacker's address holds its cap; the prober's two connections are another address's
        assert s.server_open <= CAP_PER_CLIENT + 2, s.line(target)
        # held until its timeout (not refused at once: a process out of files resets it), then cut
        assert timeout_s - 1 <= s.cut_s <= timeout_s + 5, s.line(target)
        if mode == "-H":
            assert s.cut_answer.startswith(b"HTTP/1.1 408 "), s.cut_answer[:200]


def test_slowhttptest_cannot_take_the_release_api_away(kafka_settings, topics, tiny_model_dir, tmp_path):
    from conftest import stage_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**stage_env(kafka_settings, topics, tmp_path), "FLYWHEEL_MODEL_DIR": str(tiny_model_dir),
           "FLYWHEEL_RELEASE_PORT": str(port), "FLYWHEEL_RELEASE_GROUP_ID": f"{topics.prefix}release",
           "FLYWHEEL_LOG_LEVEL": "INFO"}
    log = tmp_path / "release.log"
    proc = start(["release", "serve"], env, url + "/health", ready_s=120, log=log)
    try:
        hold_and_check(url, "/api/rollback", "release", tmp_path, "release API")
    finally:
        stop(proc)
    assert RAISED_TO_HARD in log.read_text()


def test_slowhttptest_cannot_take_serving_away(broker, topics, tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"FLYWHEEL_MODEL_DIR": str(tiny_model_dir), "FLYWHEEL_DATA_DIR": str(tmp_path),
           "FLYWHEEL_API_KEYS": "sk-slow", "FLYWHEEL_SERVE_USER_ID_SALT": "slow-clients-salt",
           "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap, "FLYWHEEL_TOPIC_PREFIX": topics.prefix,
           "FLYWHEEL_SERVE_PORT": str(port), "FLYWHEEL_SERVE_ENGINES": "1",
           "FLYWHEEL_SERVE_FOLLOW_RELEASES": "false", "FLYWHEEL_LOG_LEVEL": "INFO"}
    log = tmp_path / "serve.log"
    proc = start(["serve"], env, url + "/readyz", ready_s=420, log=log)
    try:
        hold_and_check(url, "/v1/completions", "serving", tmp_path, "serving")
    finally:
        stop(proc)
    assert RAISED_TO_HARD in log.read_text()
