"""Webhook notifications of release decisions (``release.webhooks``): every decision
(release/decisions.py) is POSTed as JSON to every configured URL, never from the controller's turn
or a person's request.

Each receiver (one URL) has a queue and a delivery thread of its own, so a slow or dead receiver
delays only its own bodies: one that never answers costs ``release.webhook_attempts`` timeouts and
backoffs per decision (about 65 s at the defaults), and in one shared queue every other receiver
waited that long behind it. A receiver's bodies go out in the order of its decisions.

Delivery: a 2xx answer delivers a body. Anything else (a refused connection, a timeout, a 4xx or
5xx) is retried after ``release.webhook_backoff_s``, doubling each time (at most a minute), up to
``release.webhook_attempts`` attempts; then the body is given up. Each receiver queues at most
:data:`MAX_QUEUED` bodies; one more is dropped. Unless ``release.webhook_allow_internal``, the
receiver's host is resolved at each attempt and the body is refused (not retried) when any of its
addresses is internal (flywheel/addresses.py); otherwise it is sent to the address checked, so a
second, different DNS answer cannot point the request elsewhere. Every outcome is counted in
``release_webhook_deliveries_total{outcome}`` (:class:`Outcome`), and the alert
``FlywheelReleaseWebhookFailing`` tickets on bodies given up, dropped or refused
(dashboards/runbooks/release-webhooks.md). The queues are in memory: a decision made just before
the process stops may go unsent (the audit log keeps it, ``flywheel release audit``); a receiver
that must not miss one reads the audit log as well. A body may arrive twice (an answer lost after
the receiver took it): ``audit_id`` tells them apart.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter

from flywheel.addresses import IPAddress, is_internal
from release.decisions import Decision
from release.store import AuditEntry

log = logging.getLogger(__name__)

#: Bodies one receiver may have waiting; past this a new one is dropped at once (a receiver down
#: for hours must not grow the controller's memory without end).
MAX_QUEUED = 10_000
#: The longest wait between two attempts at one body.
MAX_BACKOFF_S = 60.0


class Outcome(StrEnum):
    """``release_webhook_deliveries_total{outcome}``."""

    DELIVERED = "delivered"
    #: an attempt failed; another follows
    RETRIED = "retried"
    #: given up after ``release.webhook_attempts`` attempts (or unsent at shutdown)
    FAILED = "failed"
    #: the receiver's queue was full
    DROPPED = "dropped"
    #: the receiver's host resolved to an internal address (``release.webhook_allow_internal``)
    REFUSED = "refused"


@dataclass(frozen=True)
class Attempt:
    """How one POST went: ``outcome`` is DELIVERED, FAILED (worth retrying) or REFUSED (not)."""

    outcome: Outcome
    why: str = ""


class InternalTarget(Exception):
    """The receiver's host resolved to an internal address; ``str()`` says which kind."""


class Webhooks:
    """An audit listener (``store.listeners``) that sends each decision to ``urls``, a queue and a
    thread per URL; :meth:`close` stops them (bodies still queued are given up and counted).
    ``verify`` is the TLS trust httpx uses (a private CA's context; default: the system's)."""

    def __init__(self, urls: tuple[str, ...], deployment: str, registry: CollectorRegistry, *,
                 attempts: int, backoff_s: float, timeout_s: float = 10.0, allow_internal: bool = False,
                 max_queued: int = MAX_QUEUED, verify: ssl.SSLContext | bool = True) -> None:
        self.deployment = deployment
        self.deliveries = Counter("release_webhook_deliveries_total",
                                  "Webhook deliveries of release decisions, by outcome: delivered, retried (an "
                                  "attempt failed), failed (given up after release.webhook_attempts), dropped "
                                  "(the receiver's queue was full), refused (its host resolved to an internal "
                                  "address)", ["outcome"], registry=registry)
        for outcome in Outcome:  # every series from the start: increase() sees the first
            self.deliveries.labels(outcome.value)
        self.stopping = threading.Event()
        self.receivers = [Receiver(url, self, attempts=attempts, backoff_s=backoff_s, timeout_s=timeout_s,
                                   allow_internal=allow_internal, max_queued=max_queued, verify=verify)
                          for url in urls]

    def __call__(self, entry: AuditEntry) -> None:
        decision = Decision.of(entry)
        if decision is None:
            return
        body = decision.body(self.deployment)
        for receiver in self.receivers:
            receiver.offer(body)

    def count(self, outcome: Outcome) -> None:
        self.deliveries.labels(outcome.value).inc()

    def close(self, timeout_s: float = 5.0) -> None:
        self.stopping.set()
        for receiver in self.receivers:
            receiver.wake()
        deadline = time.monotonic() + timeout_s
        for receiver in self.receivers:
            receiver.thread.join(max(0.0, deadline - time.monotonic()))
            receiver.http.close()


class Receiver:
    """One URL: its queue, its delivery thread, its HTTP client."""

    def __init__(self, url: str, hooks: Webhooks, *, attempts: int, backoff_s: float, timeout_s: float,
                 allow_internal: bool, max_queued: int, verify: ssl.SSLContext | bool) -> None:
        self.url, self.shown, self.hooks = url, _shown(url), hooks
        self.attempts, self.backoff_s, self.allow_internal = attempts, backoff_s, allow_internal
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max_queued)
        self.http = httpx.Client(timeout=timeout_s, verify=verify)
        self.thread = threading.Thread(target=self._run, name=f"release-webhook {self.shown}", daemon=True)
        self.thread.start()

    def offer(self, body: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(body)
        except queue.Full:
            self.hooks.count(Outcome.DROPPED)
            log.error("webhook %s: queue full (%d bodies): decision %s dropped", self.shown, self.queue.maxsize,
                      body.get("audit_id"))

    def wake(self) -> None:
        """Ends a wait for the next body (a thread busy with one sees ``stopping`` after it)."""
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass

    def _run(self) -> None:
        while not self.hooks.stopping.is_set() and (body := self.queue.get()) is not None:
            try:
                self._deliver(body)
            except Exception:  # one body nothing foresaw must not end every later delivery
                self.hooks.count(Outcome.FAILED)
                log.exception("webhook %s: decision %s not sent", self.shown, body.get("audit_id"))
        while True:  # stopping: what is left is given up, and counted
            try:
                if self.queue.get_nowait() is not None:
                    self.hooks.count(Outcome.FAILED)
            except queue.Empty:
                return

    def _deliver(self, body: dict[str, Any]) -> None:
        for attempt in range(1, self.attempts + 1):
            result = self._post(body)
            if result.outcome is not Outcome.FAILED:
                self.hooks.count(result.outcome)
                if result.outcome is Outcome.REFUSED:
                    log.error("webhook %s: decision %s refused: %s (release.webhook_allow_internal is off)",
                              self.shown, body["audit_id"], result.why)
                return
            if attempt == self.attempts or self.hooks.stopping.is_set():
                break
            self.hooks.count(Outcome.RETRIED)
            log.warning("webhook %s: attempt %d of %d failed (%s); retrying", self.shown, attempt, self.attempts,
                        result.why)
            if self.hooks.stopping.wait(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)):
                break
        self.hooks.count(Outcome.FAILED)
        log.error("webhook %s: decision %s given up after %d attempts (%s)", self.shown, body["audit_id"], attempt,
                  result.why)

    def _post(self, body: dict[str, Any]) -> Attempt:
        try:
            url = httpx.URL(self.url)
            address = resolve(url.host, url.port or (443 if url.scheme == "https" else 80), self.allow_internal)
            # to the address checked, naming the host as the URL does (Host header, TLS server
            # name and certificate check): a second lookup could answer otherwise
            resp = self.http.post(url.copy_with(host=str(address)), json=body,
                                  headers={"Host": url.netloc.decode("ascii")},
                                  extensions={"sni_hostname": url.host} if url.scheme == "https" else {})
        except InternalTarget as exc:
            return Attempt(Outcome.REFUSED, str(exc))
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:  # settings refuse a URL httpx cannot send to
            return Attempt(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
        return Attempt(Outcome.DELIVERED) if resp.is_success else Attempt(Outcome.FAILED, f"HTTP {resp.status_code}")


def resolve(host: str, port: int, allow_internal: bool) -> IPAddress:
    """The address to send to: ``host`` resolved (a literal address is itself). Raises
    :class:`InternalTarget` when any address it resolves to is internal, unless allowed: a name
    that also answers with an internal address is not sent to at all. ``OSError`` (socket.gaierror)
    when it does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not allow_internal:
        internal = [a for a in addresses if is_internal(a)]
        if internal:
            raise InternalTarget(f"{host} resolves to an internal address ({_kind(internal[0])})")
    return addresses[0]


def _kind(ip: IPAddress) -> str:
    """What kind of internal address ``ip`` is, for the log."""
    for kind in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return "not globally reachable"


def _shown(url: str) -> str:
    """A webhook URL as logs show it: scheme, host and port only. Chat tools put their secret in
    the path (``https://hooks.slack.com/services/T000/B000/XXXX``)."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return "(a URL that does not parse)"
    return f"{u.scheme}://{u.host}" + (f":{u.port}" if u.port else "")


__all__ = ["Attempt", "InternalTarget", "Outcome", "Receiver", "Webhooks", "resolve"]
