"""Publishes serving's events to Kafka off the response path, falling back to a local journal.

Request handlers never talk to the broker. They hand events to :class:`Recorder`:

* ``record_generation`` enqueues and returns at once (a full in-memory queue counts the event as
  dropped: generations are telemetry for the learner, not a promise made to a user);
* ``record_feedback`` enqueues and returns a future that resolves once the event is *durable*:
  acked by the broker (``acks=all``) or fsync'd in the local journal. The API answers 202 only
  then; a full journal fails the future with :class:`~serving.journal.JournalFull` (503).

Two threads own the producer:

* the *intake* thread takes batches from the queue. While the journal is empty it sends them and
  waits up to ``ack_timeout_s`` for the acks; whatever is not acked by then goes to the journal,
  in queue order, and the producer is force-closed (its unsent batches aborted) so a stalled
  broker does not hold memory. While the journal is non-empty every new event is appended behind
  it, so events reach the topic in the order serving accepted them.
* the *replay* thread (re)connects the producer, so only it ever blocks on a dead broker, and
  sends journal entries oldest first, waits for their acks, then advances the journal head past
  the acked prefix; on a failure it backs off and retries with a new producer, waiting longer
  for acks or sending smaller batches, so a slow broker still drains it. A send refused (no
  topic metadata within the ack timeout) or a wait spent ends a batch's sends, so one try never
  takes one wait per event; a replay that keeps failing logs a warning every 30 s. On start-up it
  replays whatever a previous process left in the journal. Events that arrive before the first
  connection go through the journal too.

Delivery is at-least-once. A send that timed out may still have reached the broker (it was on the
wire when the stall began, and is then also journaled), and a crash between an ack and the head
update replays a frame. Downstream stages dedupe by ``feedback_id`` / ``generation_id``. Events
acked in a batch where an earlier one failed are not journaled again (no needless duplicates);
order is kept among journaled events and within a partition otherwise.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from flywheel.contracts import FeedbackEvent, GenerationEvent, encode
from flywheel.kafka.clients import force_close, make_producer
from flywheel.settings import KafkaSettings
from serving.journal import Headers, Journal, JournalFull

log = logging.getLogger(__name__)

BATCH = 500
# A broker that is alive but slower than ``ack_timeout_s`` (a cold producer's first metadata
# round, a loaded host) must still drain the journal: each replay that acks nothing doubles its
# wait up to this cap (below ``stop``'s join timeout), and a replay that acks only part of its
# batch halves the next one. Only the intake thread answers to the response path's bound.
REPLAY_TIMEOUT_MAX_S = 8.0
# A replay that keeps failing says so in the log, at most this often, with what it last saw.
REPLAY_WARN_EVERY_S = 30.0


@dataclass
class _Item:
    kind: str
    topic: str
    key: str | None
    value: bytes
    done: Future | None = field(default=None)
    #: Kafka headers: the request's id and trace context (flywheel/telemetry.py); journaled with it.
    headers: Headers | None = None


def _resolve(done: Future | None, exc: BaseException | None = None) -> None:
    """Settle a feedback future once; one a waiter gave up on (cancelled) is left alone."""
    if done is None or done.done():
        return
    try:
        if exc is None:
            done.set_result(True)
        else:
            done.set_exception(exc)
    except InvalidStateError:  # cancelled between the check and the set
        pass


class RecorderMetrics:
    def __init__(self, registry: CollectorRegistry, journal: Journal) -> None:
        self.published = Counter(
            "serving_events_published_total", "Events acked by the broker", ["kind", "path"],
            registry=registry,
        )
        self.journaled = Counter(
            "serving_events_journaled_total", "Events written to the local journal", ["kind"],
            registry=registry,
        )
        self.failures = Counter(
            "serving_publish_failures_total",
            "Sends not acked within the ack timeout (or refused by the client)", ["path"],
            registry=registry,
        )
        self.dropped = Counter(
            "serving_dropped_events_total", "Events lost on purpose, by kind and reason",
            ["kind", "reason"], registry=registry,
        )
        # Exported at 0 from the start. A labeled series that first appears at 5 has no earlier
        # sample, so increase() in the FlywheelEventsDropped page would miss a one-off burst.
        for reason in ("invalid", "queue_full", "journal_full"):
            self.dropped.labels("generation", reason)
        Gauge(
            "serving_journal_depth_records", "Undelivered records in the local journal",
            registry=registry,
        ).set_function(lambda: journal.records)
        Gauge(
            "serving_journal_depth_bytes", "Bytes counted against the journal bound",
            registry=registry,
        ).set_function(lambda: journal.size_bytes)


class Recorder:
    """Owns the producer and the journal; see the module docstring for the protocol."""

    def __init__(
        self,
        kafka: KafkaSettings,
        journal: Journal,
        registry: CollectorRegistry,
        *,
        ack_timeout_s: float,
        queue_max: int = 100_000,
        retry_interval_s: float = 0.5,
        producer_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.journal = journal
        self.ack_timeout_s = ack_timeout_s
        self.retry_interval_s = retry_interval_s
        self.metrics = RecorderMetrics(registry, journal)
        # bounded blocking: a stalled broker must not hold a publisher thread for kafka-python's
        # defaults (60 s per send for metadata, 30 s to bootstrap a new producer)
        block_ms = int(ack_timeout_s * 1000)
        self._factory = producer_factory or (lambda: make_producer(
            kafka, "serving", max_block_ms=block_ms, bootstrap_timeout_ms=max(1000, block_ms),
        ))
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=queue_max)
        self._producer: Any = None
        self._plock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.last_error: str | None = None
        self._replay_batch = BATCH
        self._replay_timeout_s = ack_timeout_s
        self._replay_warned_at: float | None = None

    # -- public API (any thread) ---------------------------------------------------------------
    def start(self) -> Recorder:
        if self.journal.records:
            log.warning("replaying %d journaled events left by a previous process", self.journal.records)
        for name, target in (("recorder-intake", self._intake), ("recorder-replay", self._replay)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def record_generation(self, topic: str, event: GenerationEvent, headers: Headers | None = None) -> bool:
        try:
            self._queue.put_nowait(_Item("generation", topic, event.generation_id, encode(event), headers=headers))
            return True
        except queue.Full:
            self.metrics.dropped.labels("generation", "queue_full").inc()
            return False

    def record_feedback(self, topic: str, event: FeedbackEvent, headers: Headers | None = None) -> Future:
        done: Future = Future()
        try:
            self._queue.put_nowait(
                _Item("feedback", topic, event.generation_id, encode(event), done, headers)
            )
        except queue.Full:
            done.set_exception(JournalFull("the publish queue is full; retry shortly"))
        return done

    def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver or journal everything queued, then stop both threads and close the producer."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout_s)
        with self._plock:
            if self._producer is not None:
                try:
                    self._producer.close(timeout=min(timeout_s, self.ack_timeout_s))
                except Exception:  # noqa: BLE001 - unacked at shutdown: those events are already journaled
                    force_close(self._producer)
                self._producer = None
        self.journal.close()

    def state(self) -> dict[str, object]:
        return {
            "publisher": "degraded" if self.journal.records else "ok",
            "queue_depth": self._queue.qsize(),
            "journal_records": self.journal.records,
            "journal_bytes": self.journal.size_bytes,
            "last_error": self.last_error,
        }

    # -- producer ----------------------------------------------------------------------------
    def _get_producer(self) -> Any:
        with self._plock:
            if self._producer is None:
                try:
                    self._producer = self._factory()
                except Exception as exc:  # noqa: BLE001 - broker unreachable at connect: caller journals
                    self.last_error = f"producer: {exc!r}"
                    return None
            return self._producer

    def _discard_producer(self, producer: Any) -> None:
        with self._plock:
            if self._producer is producer:
                self._producer = None
        force_close(producer)

    def _send_all(self, producer: Any, items: list[tuple[str, str | None, bytes, Headers | None]],
                  timeout_s: float | None = None) -> list[bool]:
        """Send and wait up to ``timeout_s`` (the ack timeout); ``acked[i]`` says which made it."""
        wait_s = self.ack_timeout_s if timeout_s is None else timeout_s
        futures: list[Any] = [None] * len(items)
        # A send blocks up to max_block_ms while the producer has no metadata for the topic (a new
        # producer on a slow or stalled broker, a topic it has not sent to yet). One refusal or a
        # spent wait ends the batch: the rest count as not acked, where each would block again
        # (500 sends: many minutes in which the journal neither drains nor says why).
        stop_sending_at = time.monotonic() + wait_s
        for i, (topic, key, value, headers) in enumerate(items):
            try:
                futures[i] = producer.send(topic, key=key, value=value, headers=headers)
            except Exception as exc:  # noqa: BLE001 - any refusal means "not acked": journal it
                self.last_error = f"send: {exc!r}"
                break
            if time.monotonic() > stop_sending_at:
                break
        deadline = time.monotonic() + wait_s
        acked = []
        for fut in futures:
            ok = False
            if fut is not None:
                try:
                    fut.get(timeout=max(0.0, deadline - time.monotonic()))
                    ok = True
                except Exception as exc:  # noqa: BLE001 - timeout or broker error: not acked
                    self.last_error = f"ack: {exc!r}"
            acked.append(ok)
        return acked

    # -- intake thread -----------------------------------------------------------------------
    def _take(self) -> list[_Item]:
        try:
            batch = [self._queue.get(timeout=0.2)]
        except queue.Empty:
            return []
        while len(batch) < BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _intake(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._take()
            if batch:
                try:
                    self._deliver(batch)
                except Exception as exc:  # never let the publisher die; journal what we hold
                    log.exception("publisher batch failed")
                    self.last_error = repr(exc)
                    self._to_journal([b for b in batch if not (b.done and b.done.done())])

    def _deliver(self, batch: list[_Item]) -> None:
        # Only a producer that already exists: creating one can block on a dead broker, and the
        # intake thread must stay responsive (it journals instead; the replay thread reconnects).
        producer = None if self.journal.records else self._producer
        if producer is None:
            self._to_journal(batch)
            return
        acked = self._send_all(producer, [(b.topic, b.key, b.value, b.headers) for b in batch])
        failed = [b for b, ok in zip(batch, acked) if not ok]
        for b, ok in zip(batch, acked):
            if ok:
                self.metrics.published.labels(b.kind, "direct").inc()
                _resolve(b.done)
        if failed:
            self.metrics.failures.labels("direct").inc(len(failed))
            log.warning("%d events not acked in %.1fs; journaling them", len(failed), self.ack_timeout_s)
            self._discard_producer(producer)
            self._to_journal(failed)

    def _to_journal(self, items: list[_Item]) -> None:
        if not items:
            return
        try:
            self.journal.append([(b.topic, b.key, b.value, b.headers) for b in items])
        except JournalFull as exc:
            self._refuse(items, exc)
            return
        for b in items:
            self.metrics.journaled.labels(b.kind).inc()
            _resolve(b.done)
        self._wake.set()

    def _refuse(self, items: list[_Item], exc: JournalFull) -> None:
        """Journal full: feedback is refused (the client sees 503 and retries), never dropped."""
        for b in items:
            if b.done is not None:
                _resolve(b.done, exc)
            else:
                self.metrics.dropped.labels(b.kind, "journal_full").inc()

    # -- replay thread -----------------------------------------------------------------------
    def _replay(self) -> None:
        while not self._stop.is_set():
            if not self.journal.records:
                if self._producer is None and self._get_producer() is None:
                    self._stop.wait(self.retry_interval_s)  # connect ahead of the next event
                    continue
                self._wake.wait(0.2)
                self._wake.clear()
                continue
            if not self._replay_once():
                self._warn_replay_failing()
                self._stop.wait(self.retry_interval_s)

    def _warn_replay_failing(self) -> None:
        now = time.monotonic()
        if self._replay_warned_at is None or now - self._replay_warned_at >= REPLAY_WARN_EVERY_S:
            self._replay_warned_at = now
            log.warning("journal replay failed; %d events wait in the journal (last error: %s)",
                        self.journal.records, self.last_error)

    def _replay_once(self) -> bool:
        entries = self.journal.peek(self._replay_batch)
        producer = self._get_producer()
        if producer is None:
            return False
        acked = self._send_all(producer, [(e.topic, e.key, e.value, e.headers) for e in entries],
                               self._replay_timeout_s)
        prefix = 0
        while prefix < len(acked) and acked[prefix]:
            prefix += 1
        self.journal.advance(entries[:prefix])
        for e in entries[:prefix]:
            kind = "feedback" if e.topic.endswith("feedback") else "generation"
            self.metrics.published.labels(kind, "replay").inc()
        if prefix < len(entries):
            self.metrics.failures.labels("replay").inc(len(entries) - prefix)
            self._discard_producer(producer)
            if prefix == 0:
                self._replay_timeout_s = min(REPLAY_TIMEOUT_MAX_S, 2 * self._replay_timeout_s)
            else:
                self._replay_batch = max(1, len(entries) // 2)
            return False
        self._replay_batch = min(BATCH, 2 * self._replay_batch)
        self._replay_timeout_s = max(self.ack_timeout_s, self._replay_timeout_s / 2)
        if not self.journal.records:
            self._replay_warned_at = None
            log.info("journal drained; publishing directly again")
        return True
