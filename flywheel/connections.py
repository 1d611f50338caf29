"""Holding an HTTP server's connections against slow and greedy clients: serving's API
(serving/server.py) and the release API (release/main.py) are both built on :func:`server_config`.

uvicorn times only the idle gap after a response (``timeout_keep_alive``): a connection that
never completes its request's headers, sending a byte every few seconds, stays open for ever, and
a few hundred of them spend the process's open files until ``/health`` cannot be accepted (a
slow-loris attack; no API key needed). :class:`ConnectionGuard` adds, per server:

- a header deadline (``http.header_timeout_s``), armed when a connection opens and when the first
  byte of a kept-alive connection's next request arrives, cancelled once the headers are complete;
- a body deadline (``http.body_timeout_s``) from the headers to the request's last byte (for a
  pipelined request queued behind a response, from its turn: uvicorn reads nothing meanwhile).
  Only reading the request is timed: a response (a stream, a long generation) never is;
- a cap on a request's line and headers (``http.max_head_bytes``): httptools keeps a head whole
  until it ends, and a fast client could otherwise fill the memory within the header deadline
  (86 MB of one header in 10 s on loopback);
- a cap on open connections per process and per client address, judged by :func:`admit` when a
  connection opens, before it costs a request.

A request cut by a deadline gets 408 (431 for a head too large) and its connection is closed (closed with no answer when not
one byte came: what a browser's idle pre-connection expects); a connection over a cap gets 429 (its
address holds its share) or 503 (the process is full) and is closed. Cuts are counted in
``<component>_connections_cut_total{reason}`` and logged once a minute per reason.

The hooks are uvicorn's ``Config(http=<protocol class>)`` with a subclass of its httptools
protocol: ``connection_made``/``connection_lost``/``data_received`` are asyncio's protocol
interface and ``on_message_begin``/``on_headers_complete``/``on_message_complete`` httptools'
parser callbacks. Three uvicorn details are used beyond them, each held by a test in
tests/integration/test_connections.py: ``self.cycle`` (the request's ASGI state, marked
disconnected when its body times out, so the app sees ``http.disconnect`` and writes nothing after
the 408), ``self.pipeline`` with ``on_response_complete`` (pipelined requests queued behind a
response, and the call that starts the next) and ``self.connections`` (uvicorn's set of open
connections, left untouched for a refused one, which is never uvicorn's). :func:`raise_open_files` lifts the open-file limit the caps need.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

from flywheel.settings import HttpSettings

log = logging.getLogger(__name__)

#: Open files a serving or release process needs beside its clients' connections: engine and
#: tokenizer files, Kafka and database sockets, the journal, the model's shards, logs.
FILES_BESIDE_CONNECTIONS = 512

#: How often the cuts of one reason are logged (the counter has them all; an attack must not flood
#: the log with a line per connection).
LOG_EVERY_S = 60.0


class Cut(enum.Enum):
    """Why a connection was closed by the guard (the ``reason`` label)."""

    HEADER_TIMEOUT = "header_timeout"
    """Its request's headers were not complete within ``http.header_timeout_s``: 408."""
    BODY_TIMEOUT = "body_timeout"
    """Its request's body was not complete within ``http.body_timeout_s``: 408."""
    HEAD_TOO_LARGE = "head_too_large"
    """Its request's line and headers went past ``http.max_head_bytes``: 431."""
    CLIENT_CAP = "client_cap"
    """Its address already held ``http.max_connections_per_client`` connections: 429."""
    PROCESS_CAP = "process_cap"
    """The process already held ``http.max_connections`` connections: 503."""


def admit(open_total: int, open_client: int, limits: HttpSettings) -> Cut | None:
    """Whether one more connection may open, given those open now (total, and from its address):
    None, or the cap it would break. The process cap is judged first: a full process refuses
    everyone alike."""
    if open_total >= limits.max_connections:
        return Cut.PROCESS_CAP
    if limits.max_connections_per_client and open_client >= limits.max_connections_per_client:
        return Cut.CLIENT_CAP
    return None


_REFUSALS = {
    Cut.HEADER_TIMEOUT: (408, "Request Timeout", "the request was not received in time"),
    Cut.BODY_TIMEOUT: (408, "Request Timeout", "the request was not received in time"),
    Cut.HEAD_TOO_LARGE: (431, "Request Header Fields Too Large", "the request line and headers are too long"),
    Cut.CLIENT_CAP: (429, "Too Many Requests", "too many open connections from this address"),
    Cut.PROCESS_CAP: (503, "Service Unavailable", "the server holds as many connections as it may"),
}


def refusal(cut: Cut) -> bytes:
    """The whole HTTP/1.1 response a connection cut for ``cut`` gets before it is closed."""
    status, phrase, text = _REFUSALS[cut]
    body = f'{{"error": {{"message": "{text}", "type": "{cut.value}"}}}}'.encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status in (429, 503):  # a full process or address may have room again soon
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


class ConnectionGuard:
    """The open connections and cuts of one server; :attr:`protocol` is its uvicorn protocol class."""

    def __init__(self, limits: HttpSettings, on_cut: Callable[[Cut], None] | None = None) -> None:
        self.limits = limits
        self.open_total = 0
        self.open_by_client: Counter[str] = Counter()
        self.cuts: Counter[Cut] = Counter()
        self._on_cut = on_cut
        self._logged: dict[Cut, tuple[float, int]] = {}
        self.protocol: type[HttpToolsProtocol] = type("GuardedProtocol", (_GuardedProtocol,), {"guard": self})

    def open(self, client: str) -> Cut | None:
        if (refused := admit(self.open_total, self.open_by_client[client], self.limits)) is None:
            self.open_total += 1
            self.open_by_client[client] += 1
        return refused

    def close(self, client: str) -> None:
        self.open_total -= 1
        self.open_by_client[client] -= 1
        if not self.open_by_client[client]:
            del self.open_by_client[client]  # the counter does not grow with every address ever seen

    def cut(self, cut: Cut) -> None:
        self.cuts[cut] += 1
        if self._on_cut is not None:
            self._on_cut(cut)
        now = time.monotonic()
        last, count = self._logged.get(cut, (float("-inf"), 0))
        if now - last >= LOG_EVERY_S:
            log.warning("closed %d connection(s) for %s since the last such line (http settings: %s)",
                        self.cuts[cut] - count, cut.value, _setting_of(cut))
            self._logged[cut] = (now, self.cuts[cut])

    def count_in(self, registry: CollectorRegistry, component: str) -> None:
        """Export the open connections and the cuts as ``<component>_connections_open`` and
        ``<component>_connections_cut_total{reason}``."""
        cuts = PromCounter(f"{component}_connections_cut", "Connections closed by the connection guard, by reason "
                           "(flywheel/connections.py)", ["reason"], registry=registry)
        for reason in Cut:
            cuts.labels(reason.value)  # every reason shows from the start, at 0
        Gauge(f"{component}_connections_open", "Open client connections of the API",
              registry=registry).set_function(lambda: self.open_total)
        self._on_cut = lambda cut: cuts.labels(cut.value).inc()


def _setting_of(cut: Cut) -> str:
    return {Cut.HEADER_TIMEOUT: "header_timeout_s", Cut.BODY_TIMEOUT: "body_timeout_s",
            Cut.HEAD_TOO_LARGE: "max_head_bytes", Cut.CLIENT_CAP: "max_connections_per_client",
            Cut.PROCESS_CAP: "max_connections"}[cut]


class _GuardedProtocol(HttpToolsProtocol):
    guard: ConnectionGuard  # set on the per-server subclass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: str | None = None  # set once admitted
        self._deadline: asyncio.TimerHandle | None = None
        self._began = False  # a byte of the request being read has arrived
        self._in_head = True  # reading a request's line and headers (a new connection's first)
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = get_remote_addr(transport)
        client = peer[0] if peer else ""
        if (refused := self.guard.open(client)) is not None:
            # refused before uvicorn knows of it: not in its connections, so no shutdown waits for it
            self.guard.cut(refused)
            transport.write(refusal(refused))
            transport.close()
            return
        self._client = client
        super().connection_made(transport)
        self._arm(self.guard.limits.header_timeout_s, Cut.HEADER_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is None:
            return
        self.guard.close(self._client)
        self._client = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._client is None:
            return
        # httptools holds a head until it ends, so its size is counted here, in the chunks read
        # while it lasts. A chunk in which a kept-alive connection's next head begins is not
        # counted (at most one read, 256 kB): a whole chunk would count the last request's tail.
        counted = self._in_head
        super().data_received(data)
        if counted and self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.guard.limits.max_head_bytes:
                self._disarm()
                self.guard.cut(Cut.HEAD_TOO_LARGE)
                self.transport.write(refusal(Cut.HEAD_TOO_LARGE))
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        self._in_head, self._head_bytes = True, 0
        if self._deadline is None:  # a kept-alive connection's next request: its clock starts now
            self._arm(self.guard.limits.header_timeout_s, Cut.HEADER_TIMEOUT)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        super().on_headers_complete()
        if not self.pipeline:
            self._arm(self.guard.limits.body_timeout_s, Cut.BODY_TIMEOUT)
        # else: queued behind a response being answered (a pipelined request): uvicorn stopped
        # reading, so its body cannot come; its clock starts when its turn does (on_response_complete)

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        # uvicorn started the next queued request and reads again: if it is the one whose body is
        # being read (the last queued) and its body is not all here, its body deadline starts now
        if (queued and not self.pipeline and self._client is not None and not self.transport.is_closing()
                and not self._in_head and self.cycle is not None and self.cycle.more_body):
            self._arm(self.guard.limits.body_timeout_s, Cut.BODY_TIMEOUT)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the request is read: nothing after it (the response, a stream) is timed
        self._began = False

    def _arm(self, delay_s: float, cut: Cut) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expire, cut)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, cut: Cut) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.cut(cut)
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if cut is Cut.BODY_TIMEOUT and cycle is not None and not cycle.response_started:
            # the app may be waiting for the body: it gets http.disconnect, and whatever it sends
            # after is dropped (uvicorn's send returns at once once disconnected), not written after
            # the 408
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(refusal(cut))
        elif cut is Cut.HEADER_TIMEOUT and self._began and not answering:
            self.transport.write(refusal(cut))
        # else: nothing came (an idle pre-connection), or a response is being written (a pipelined
        # request's headers trickle behind it) or is done (the app answered before the body came):
        # the connection is closed with no response of the guard's
        self.transport.close()


def server_config(app: Any, host: str, port: int, limits: HttpSettings, guard: ConnectionGuard | None = None,
                  **extra: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` held by ``guard`` (a new one over ``limits`` if None)."""
    guard = guard if guard is not None else ConnectionGuard(limits)
    # log_config=None: uvicorn's lines (its errors) go to the process's own handler and format
    # (flywheel/logs.py: JSON with --log-format json), not to a text handler of uvicorn's
    return uvicorn.Config(app, host=host, port=port, http=guard.protocol, timeout_keep_alive=limits.keep_alive_s,
                          log_level="warning", access_log=False, lifespan="off", log_config=None, **extra)


@dataclass(frozen=True)
class OpenFiles:
    """The process's open-file limit after :func:`raise_open_files`, and what its caps need."""

    before: int
    """The soft limit the process started with."""
    soft: int
    """The soft limit now (the hard one, unless the hard one is unlimited or could not be set)."""
    hard: int
    needed: int
    """``http.max_connections`` and :data:`FILES_BESIDE_CONNECTIONS`."""

    @property
    def enough(self) -> bool:
        return self.soft >= self.needed


def raise_open_files(limits: HttpSettings) -> OpenFiles:
    """Raise the soft open-file limit to the hard one and log it; warn when it is still below what
    ``limits`` need. An open-file limit under the connection cap brings back what the cap prevents:
    ``accept`` fails for everyone, ``/health`` included, before the guard can refuse anyone."""
    needed = limits.max_connections + FILES_BESIDE_CONNECTIONS
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit cannot be the soft one (Linux caps it at fs.nr_open): take what is needed
    target = max(before, needed) if hard == resource.RLIM_INFINITY else hard
    if target > before:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", before, target, exc)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = OpenFiles(before=before, soft=soft, hard=hard, needed=needed)
    if not files.enough:
        log.warning("the open-file limit is %d (hard %d), below the %d that http.max_connections=%d and the process's "
                    "own files need: raise the hard limit (ulimit -Hn, systemd's LimitNOFILE, the container runtime's "
                    "nofile ulimit) or lower http.max_connections", soft, hard, needed, limits.max_connections)
    else:
        log.info("open-file limit %d (was %d, hard %d); http.max_connections=%d needs %d", soft, before, hard,
                 limits.max_connections, needed)
    return files


__all__ = ["FILES_BESIDE_CONNECTIONS", "ConnectionGuard", "Cut", "OpenFiles", "admit", "raise_open_files",
           "refusal", "server_config"]
