"""Webhook notifications of release decisions (``release.webhooks``): every decision
(release/decisions.py) is POSTed as JSON to every configured URL, from a thread of its own so that
a slow or dead receiver never holds up the controller's turn or a person's request.

Delivery: a 2xx answer delivers a body. Anything else (a refused connection, a timeout, a 4xx or
5xx) is retried after ``release.webhook_backoff_s``, doubling each time (at most a minute), up to
``release.webhook_attempts`` attempts; then the body is given up. Every attempt that failed and
every body given up is counted in ``release_webhook_deliveries_total{outcome="retried"|"failed"}``
beside ``outcome="delivered"``, and the alert ``FlywheelReleaseWebhookFailing`` tickets on bodies
given up (dashboards/runbooks/release-webhooks.md). The queue is in memory: a decision made just
before the process stops may go unsent (the audit log keeps it, ``flywheel release audit``); a
receiver that must not miss one reads the audit log as well. A body may arrive twice (an answer
lost after the receiver took it): ``audit_id`` tells them apart.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter

from release.decisions import Decision
from release.store import AuditEntry

log = logging.getLogger(__name__)

#: Bodies waiting to be sent; past this a new one is given up at once (a receiver down for hours
#: must not grow the controller's memory without end).
MAX_QUEUED = 10_000
#: The longest wait between two attempts at one body.
MAX_BACKOFF_S = 60.0


class Webhooks:
    """An audit listener (``store.listeners``) that sends each decision to ``urls``; :meth:`close`
    stops its thread (bodies still queued are given up and counted)."""

    def __init__(self, urls: tuple[str, ...], deployment: str, registry: CollectorRegistry, *,
                 attempts: int, backoff_s: float, timeout_s: float = 10.0) -> None:
        self.urls, self.deployment = urls, deployment
        self.attempts, self.backoff_s = attempts, backoff_s
        self.deliveries = Counter("release_webhook_deliveries_total",
                                  "Webhook deliveries of release decisions, by outcome: delivered, retried (an "
                                  "attempt failed), failed (given up after release.webhook_attempts)",
                                  ["outcome"], registry=registry)
        for outcome in ("delivered", "retried", "failed"):  # every series from the start: increase() sees the first
            self.deliveries.labels(outcome)
        self.queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(MAX_QUEUED)
        self.stopping = threading.Event()
        self.http = httpx.Client(timeout=timeout_s)
        self.thread = threading.Thread(target=self._run, name="release-webhooks", daemon=True)
        self.thread.start()

    def __call__(self, entry: AuditEntry) -> None:
        decision = Decision.of(entry)
        if decision is None:
            return
        body = decision.body(self.deployment)
        for url in self.urls:
            try:
                self.queue.put_nowait((url, body))
            except queue.Full:
                self.deliveries.labels("failed").inc()
                log.error("webhook queue full (%d bodies): decision %d not sent to %s", MAX_QUEUED,
                          decision.audit_id, _shown(url))

    def close(self, timeout_s: float = 5.0) -> None:
        self.stopping.set()
        self.queue.put(None)
        self.thread.join(timeout_s)
        self.http.close()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                self._deliver(*item)
            except Exception:  # one body nothing foresaw must not end every later delivery
                self.deliveries.labels("failed").inc()
                log.exception("webhook %s: decision %s not sent", _shown(item[0]), item[1].get("audit_id"))
        while not self.queue.empty():  # stopping: what is left is given up, and counted
            if self.queue.get_nowait() is not None:
                self.deliveries.labels("failed").inc()

    def _deliver(self, url: str, body: dict[str, Any]) -> None:
        for attempt in range(1, self.attempts + 1):
            why = self._post(url, body)
            if why is None:
                self.deliveries.labels("delivered").inc()
                return
            if attempt == self.attempts or self.stopping.is_set():
                break
            self.deliveries.labels("retried").inc()
            log.warning("webhook %s: attempt %d of %d failed (%s); retrying", _shown(url), attempt, self.attempts, why)
            if self.stopping.wait(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)):
                break
        self.deliveries.labels("failed").inc()
        log.error("webhook %s: decision %s given up after %d attempts (%s)", _shown(url), body["audit_id"], attempt, why)

    def _post(self, url: str, body: dict[str, Any]) -> str | None:
        """None when the receiver took the body, else why not."""
        try:
            resp = self.http.post(url, json=body)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # settings refuse a URL httpx cannot send to
            return f"{type(exc).__name__}: {exc}"
        return None if resp.is_success else f"HTTP {resp.status_code}"


def _shown(url: str) -> str:
    """A webhook URL as logs show it: scheme, host and port only. Chat tools put their secret in
    the path (``https://hooks.slack.com/services/T000/B000/XXXX``)."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return "(a URL that does not parse)"
    return f"{u.scheme}://{u.host}" + (f":{u.port}" if u.port else "")


__all__ = ["Webhooks"]
