"""Runs a stream stage as a process: a stage declares itself (:class:`StageSpec`) and
:func:`serve_stage` wires it to Kafka, its state store, its archives and its ops server.

Start-up, in order: open the ops server (``/livez`` answers 200 from here on, ``/readyz`` and
``/health`` 503 until the loop runs), create the topics (waiting for a broker that does not
answer yet), lock the data_dir, open the state store (waiting for a database that fails: not
answering, read-only, full), claim the shards
(flywheel/stream/claims.py; with ``stream.database_url`` neither lock nor claims: the shared
store's leases fence each shard), run the loop (flywheel/stream/runner.py) until SIGTERM or Ctrl-C
(:func:`stop_on_signals`). Every step holds only what the ones before it opened, and is released
in reverse on any exit, a refused start included. The ops server opens first so that a stage
waiting for its broker or its shards is seen alive and not ready, never restarted for waiting.
"""

from __future__ import annotations

import fcntl
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

from flywheel.dberrors import Bug, LoginRefused, classify, describe, driver_errors
from flywheel.dburl import url_secrets
from flywheel.probes import alive
from flywheel.settings import SettingsError
from flywheel.stream.claims import STOP_CHECK_S, ShardClaims
from flywheel.stream.outbox import Archive, Outbox
from flywheel.stream.runner import (
    BROKER_ERRORS,
    RETRY_PAUSE_S,
    STOP_CLOSE_MS,
    Stage,
    StopFlag,
    StreamRunner,
)
from flywheel.stream.sql import is_postgres
from flywheel.stream.store import StateStore

T = TypeVar("T")

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from flywheel.settings import ProbeSettings, Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    """All a stage declares to run on the stream runtime; the rest is the runtime's.

    ``name`` names the process everywhere: its data_dir folder, its metrics' prefix, its Kafka
    client ids. ``tables`` is the SQL of the stage's own tables in the state store, and ``rules``
    builds the stage's logic on that store. ``outputs`` are the topics it writes (with the
    dead-letter topic); each output record carries its idempotency key, by which its readers drop
    repeats (docs/exactly-once.md).
    """

    name: str
    group_id: str
    inputs: list[str]
    outputs: list[str]
    tables: str
    rules: Callable[[StateStore, CollectorRegistry], Stage]
    archives: Callable[[], dict[str, Archive]]
    host: str
    port: int
    max_batch: int
    poll_ms: int
    #: The input partitions this process owns; empty for all of them through the consumer group.
    shards: Sequence[int] = ()


def stop_on_signals() -> threading.Event:
    """A flag set by SIGTERM or SIGINT: the loop finishes its turn, delivers and stops."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve_stage(settings: Settings, spec: StageSpec, stop: StopFlag | None = None) -> None:
    """Wire ``spec`` to Kafka, its state store and its ops server, and run it until ``stop``
    (default: SIGTERM or SIGINT)."""
    from kafka.coordinator.assignors.range import RangePartitionAssignor

    from flywheel.contracts import Topics
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.kafka.producers import make_output_producer
    from flywheel.kafka.topics import ensure_declared
    from flywheel.metrics import new_registry, serve_ops
    from flywheel.probes import Probes

    stop = stop if stop is not None else stop_on_signals()
    name, registry = spec.name, new_registry()
    with ExitStack() as held:  # released in reverse on any exit, a refused start included
        probes = StageProbes(settings.probes)
        ops = serve_ops(registry, Probes(probes.live, probes.ready), spec.host, spec.port, component=name)
        held.callback(ops.shutdown)
        log.info("%s: checking the topics on the broker at %s (ops on %s:%d)", name, settings.kafka.bootstrap,
                 spec.host, ops.server_port)
        if not until_the_broker_answers(lambda: ensure_declared(settings.kafka, Topics(settings.topic_prefix)),
                                        stop, name):
            log.info("%s: stopped before the broker answered", name)
            return  # nothing but the ops server was opened yet
        probes.phase = "opening the state store"
        store = open_store(settings, spec, held, stop)
        if store is None:
            log.info("%s: stopped before the state database worked", name)
            return
        stage = spec.rules(store, registry)
        archive_queue_gauge(name, store, registry)
        outbox_gauge(name, store, registry)
        producer = make_output_producer(settings.kafka, name)
        held.callback(producer.close)
        outbox = Outbox(store, producer, spec.archives(),
                        archive_max_rows=settings.archive.max_rows,
                        archive_max_age_s=settings.archive.max_age_s)
        # Range assignment gives one member the same partition number of every input topic,
        # which the join needs (a generation and its feedback share a partition number).
        consumer = make_consumer(settings.kafka, name, spec.group_id,
                                 partition_assignment_strategy=[RangePartitionAssignor])
        held.callback(consumer.close, autocommit=False, timeout_ms=STOP_CLOSE_MS)
        runner = StreamRunner(stage, store, outbox, consumer, spec.inputs,
                              LagGauge(name, registry), spec.max_batch, spec.poll_ms, spec.shards)
        stalled_gauge(name, runner, registry)
        claims = None
        if not store.shared:  # a shared store's leases fence its shards instead (docs/shared-state.md)
            # nothing is processed before the claims group grants this process its shards
            claims = ShardClaims(settings.kafka, name, spec.group_id, spec.inputs, store.epoch, tuple(spec.shards))
            held.callback(claims.close)
            probes.phase = "waiting for its shards to be granted"
            if not claims.wait_granted(stop):
                return  # stopped before the shards were granted: nothing was processed
        probes.running(runner, claims)
        log.info("%s running: inputs %s, outputs %s, shards %s, state %s", name, spec.inputs,
                 spec.outputs, list(spec.shards) or "all (consumer group)", store.where)
        runner.run(stop, claims.check if claims is not None else None)


def open_store(settings: Settings, spec: StageSpec, held: ExitStack, stop: StopFlag) -> StateStore | None:
    """The stage's state store, closed on exit: in ``stream.database_url`` when set, shared with
    the stage's other replicas (no data_dir lock: the leases fence each shard), else
    ``<data_dir>/<stage>/state.sqlite3``, locked to this process. None: ``stop`` came while the
    database failed."""
    from flywheel.stream.sql import namespace

    url = settings.stream.database_url
    if url:
        def make() -> StateStore:
            return StateStore.shared_store(url, namespace(spec.group_id), spec.tables)
    else:
        held.enter_context(lock_data_dir(settings.data_dir / spec.name, spec.name))  # once: a retry keeps it

        def make() -> StateStore:
            return StateStore(settings.data_dir / spec.name / "state.sqlite3", spec.tables)
    store = until_the_database_works(make, url, stop, spec.name)
    if store is not None:
        held.callback(store.close)
    return store


class DatabaseLoginRefused(SettingsError):
    """The database refused the login of a database URL's user at start (a wrong password, a role
    that may not log in): an authentication failure, exit 77 as for a refused Kafka login
    (flywheel/kafka/security.py). A running process waits such a refusal out instead
    (flywheel/dberrors.py ``LoginRefused``)."""

    exit_code = 77


def until_the_database_works(make: Callable[[], T], url: str, stop: StopFlag, name: str,
                             setting: str = "stream.database_url") -> T | None:
    """``make()`` (a store on ``url``), again every RETRY_PAUSE_S while it fails on the database
    (refused, read-only, full: any error of its driver, flywheel/dberrors.py); None if ``stop``
    came first. A process started during a failover waits for it, saying once per kind of error
    what the database does, as a running one does, instead of exiting to be restarted in a loop.
    A refused login raises :class:`DatabaseLoginRefused` naming ``setting`` (never the password),
    and an error of the statement itself (``Bug``) is raised as it is: waiting fixes neither. A
    connection a failed attempt opened is left to the garbage collector."""
    errors, said = driver_errors(url), set[str]()
    made: list[T] = []
    while not stop.is_set():
        try:
            if is_postgres(url):  # a server's connect may hang: a stop must not wait for it
                if not unless_stopped(lambda: made.append(make()), stop):
                    return None
                return made[0]
            return make()  # a file of this host (and its sqlite3 connection is for this thread only)
        except errors as exc:
            outcome = classify(exc)
            if isinstance(outcome, Bug):
                raise
            if isinstance(outcome, LoginRefused):
                raise DatabaseLoginRefused(
                    f"{name}: the database refused the login of {setting}'s user ({describe(exc, url_secrets(url))}): "
                    f"set the user and password it accepts in {setting}") from None
            if outcome.code not in said:
                said.add(outcome.code)
                log.warning("%s: the state database fails at start (%s); retrying every %.0fs until it works",
                            name, describe(exc, url_secrets(url)), RETRY_PAUSE_S)
        end = time.monotonic() + RETRY_PAUSE_S
        while not stop.is_set() and time.monotonic() < end:
            time.sleep(0.05)
    return None


class StageProbes:
    """``/livez`` and ``/readyz`` of a stage: alive while it starts (it waits for its broker and
    its shards on purpose), then while its loop turns (flywheel/probes.py); ready once it runs,
    its shards granted, and its loop has turned and made progress within ``probes.stale_s``."""

    def __init__(self, settings: ProbeSettings) -> None:
        self.settings = settings
        self.phase = "waiting for the broker"
        self._runner: StreamRunner | None = None
        self._claims: ShardClaims | None = None

    def running(self, runner: StreamRunner, claims: ShardClaims | None) -> None:
        self._claims, self._runner = claims, runner

    def live(self) -> tuple[bool, dict[str, object]]:
        if self._runner is None:
            return True, {"starting": self.phase}
        return alive(self._runner.heartbeat, self.settings.hung_s)()

    def ready(self) -> tuple[bool, dict[str, object]]:
        if self._runner is None:
            return False, {"starting": self.phase}
        ok, detail = self._runner.healthy(self.settings.stale_s)
        return ok, {**detail, "claims": self._claims.state if self._claims is not None else "leases"}


def until_the_broker_answers(call: Callable[[], None], stop: StopFlag, name: str) -> bool:
    """Run ``call`` (the start's first broker call) until it does not fail on the broker;
    False if ``stop`` came first.

    A stage started while the broker is down (a cluster restart, a node coming up first) waits
    for it, saying so once, as a running stage does, instead of exiting to be restarted in a loop.
    """
    said = False
    while not stop.is_set():
        try:
            if not unless_stopped(call, stop):
                return False
        except BROKER_ERRORS as exc:
            if not said:
                log.warning("%s: the broker does not answer at start (%s: %s); retrying until it does",
                            name, type(exc).__name__, exc)
                said = True
        else:
            return True
        end = time.monotonic() + RETRY_PAUSE_S
        while not stop.is_set() and time.monotonic() < end:
            time.sleep(0.05)
    return False


def unless_stopped(call: Callable[[], None], stop: StopFlag) -> bool:
    """Run ``call`` on a thread of its own: True once it returns (its exception is raised here),
    False as soon as ``stop`` is set, leaving it behind.

    A call blocked on a broker that does not answer (a client's bootstrap, an admin request) ends
    only at its timeout, 30 s by default: a SIGTERM then would outlast a supervisor's grace
    period. What is left behind holds nothing the stage owns, and dies with the process.
    """
    failed: list[Exception] = []

    def run() -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - raised again on the caller's thread, which decides
            failed.append(exc)

    worker = threading.Thread(target=run, name="start-call", daemon=True)
    worker.start()
    while not stop.is_set():
        worker.join(STOP_CHECK_S)
        if not worker.is_alive():
            if failed:
                raise failed[0]
            return True
    return False


def stalled_gauge(stage: str, runner: StreamRunner, registry: CollectorRegistry) -> None:
    """``<stage>_stalled_seconds``: how long the stage has made no progress with the broker, read
    at scrape time (dashboards/runbooks/stage-stalled.md)."""
    from prometheus_client import Gauge

    Gauge(f"{stage}_stalled_seconds", "Seconds without progress with the broker: turns failing in a row, "
          "or outputs owed with no ack (0 while it is fine)", registry=registry).set_function(runner.stalled_s)


def outbox_gauge(stage: str, store: StateStore, registry: CollectorRegistry) -> None:
    """``<stage>_outbox_rows``: records stored and not yet acked by Kafka, read at scrape time.

    Near the sends in flight while the broker takes them; it grows while an output cannot be
    written, and input pauses at ``MAX_OWED_ROWS`` (dashboards/runbooks/stage-stalled.md).
    """
    from prometheus_client import Gauge

    Gauge(f"{stage}_outbox_rows", "Records the stage owes to Kafka: stored in its outbox, not yet acked",
          registry=registry).set_function(lambda: store.owed)


def archive_queue_gauge(stage: str, store: StateStore, registry: CollectorRegistry) -> None:
    """``<stage>_archive_queue_rows``: rows waiting for the Parquet archive, read at scrape time.

    It saws between 0 and about ``archive.max_rows``; a queue that only grows means the archive
    is not being written (see docs/exactly-once.md).
    """
    from prometheus_client import Gauge

    Gauge(f"{stage}_archive_queue_rows", "Rows queued for the stage's Parquet archive, not yet in a file",
          registry=registry).set_function(lambda: store.queued)


class DataDirBusy(SettingsError):
    """Another live process runs this stage on the same data directory."""


def lock_data_dir(folder: Path, name: str) -> IO[bytes]:
    """Hold an exclusive lock on ``folder`` for the life of the process (released by the OS on
    any exit, ``kill -9`` included).

    Two live processes on one state store would each think they own its shards. Several
    processes of a stage need a data_dir each and disjoint ``shards``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / "lock", "ab")  # noqa: SIM115 - held open until the stage stops
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise DataDirBusy(f"another {name} process is running on {folder}: each process of a stage "
                          f"needs a data_dir of its own (and shards of its own)") from None
    return fh
