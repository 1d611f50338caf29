"""Shard claims: two live processes with different state stores never run the same shards.

A shard's join state lives in the one store that processes it (docs/exactly-once.md). Two
processes of a stage whose stores differ and whose shards overlap would each process those
shards from their own state: records counted twice, windows split. That happens by mistake (two
processes given the same ``shards``, a second consumer-group process started with another
data_dir), and nothing in Kafka's data path notices. So before it processes anything, every
stage process claims its shards:

- it joins the consumer group ``<group_id>.claims`` on the stage's inputs, which fetches nothing;
  its member metadata says which shards it runs (all of them in consumer-group mode), its store's
  epoch, where it runs, when it started and whether it already holds a grant;
- whichever member leads the group runs :func:`judge` over every member's claim and answers each
  with a verdict: granted, or denied with the claims it collides with;
- the runner waits for its first verdict, checks the latest one every loop turn, and stops with
  :class:`ShardConflict` (the CLI exits with code 2 and the message) when denied. A group that
  does not answer within ``CLAIM_WAIT_S`` does not keep the stage down: it runs unverified,
  says so in its log and in ``/health`` (``claims``), and still obeys a later verdict.

Claims with the same epoch on the same host never collide: they are one store's processes, a
restarted process and its predecessor whose session has not expired yet (the data_dir lock
keeps two live ones apart on one machine). The same epoch on two hosts is a copy of the store (a
data_dir copied or restored elsewhere) and collides like another store: both would run the same
shards from diverging copies of one state, and name their archive files alike. (A store
whose volume moved to another machine starts there once its dead predecessor's session has
expired: a join waits for every member to rejoin or expire, so no verdict judges a claim that
died before the join.) Between different stores a holder of a grant beats a newcomer, then the
earlier start wins. The data_dir lock covers one machine; this covers any number. It cannot
stop a process that stalls past the claims group's session timeout and then carries on with the
batch in hand before its next check (the classic zombie): what it then sends is a repeat its
readers drop by key, or an output of a record the new owner also processes, dropped the same way
(docs/exactly-once.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kafka.coordinator.assignors.abstract import (
    AbstractPartitionAssignor,
    ConsumerProtocolAssignment,
    ConsumerProtocolSubscription,
)

from flywheel.settings import SettingsError

if TYPE_CHECKING:
    from flywheel.settings import KafkaSettings
    from flywheel.stream.runner import StopFlag

log = logging.getLogger(__name__)


#: How long a starting process waits for the claims group's first verdict before it runs
#: unverified. A join takes a few seconds; every member must rejoin, and members poll the group
#: once per loop turn.
CLAIM_WAIT_S = 30.0
#: How often a wait at start (this one; the first broker call, flywheel/stream/serve.py) looks whether
#: the process was told to stop.
STOP_CHECK_S = 0.1


class ShardConflict(SettingsError):
    """Another live process with another state store claims some of this process's shards."""


@dataclass(frozen=True)
class Claim:
    """What one member of the claims group says about itself."""

    member: str
    epoch: str
    #: Shards it runs; None for every partition (consumer-group mode).
    shards: frozenset[int] | None
    granted: bool
    started: float
    where: str

    @property
    def host(self) -> str:
        return self.where.rsplit(":", 1)[0]

    def same_store(self, other: Claim) -> bool:
        """One store's processes: its epoch, on one machine (see the module docstring)."""
        return self.epoch == other.epoch and self.host == other.host

    def overlaps(self, other: Claim) -> bool:
        if self.shards is None or other.shards is None:
            return True
        return bool(self.shards & other.shards)

    def describe(self) -> str:
        shards = "all" if self.shards is None else ",".join(map(str, sorted(self.shards)))
        return f"store {self.epoch} on {self.where} (shards {shards})"


def judge(claims: list[Claim]) -> dict[str, list[Claim]]:
    """Each member's collisions: empty = granted. Pure, table-tested.

    Claims are considered holders of a grant first, then by start time (member id breaks ties);
    one is granted unless it overlaps an already granted claim of another store, or of a copy of
    its own store on another host.
    """
    granted: list[Claim] = []
    verdict: dict[str, list[Claim]] = {}
    for claim in sorted(claims, key=lambda c: (not c.granted, c.started, c.member)):
        hits = [g for g in granted if not g.same_store(claim) and g.overlaps(claim)]
        verdict[claim.member] = hits
        if not hits:
            granted.append(claim)
    return verdict


def _encode_claim(c: Claim) -> dict[str, Any]:
    return {"epoch": c.epoch, "shards": None if c.shards is None else sorted(c.shards),
            "granted": c.granted, "started": c.started, "where": c.where}


def _decode_claim(member: str, d: dict[str, Any]) -> Claim:
    shards = d.get("shards")
    return Claim(member, str(d.get("epoch", "?")), None if shards is None else frozenset(shards),
                 bool(d.get("granted")), float(d.get("started", 0.0)), str(d.get("where", "?")))


class ClaimAssignor(AbstractPartitionAssignor):
    """The claims group's assignor: no partitions, a verdict in each member's user data."""

    name = "flywheel-claims"
    version = 0

    def __init__(self, epoch: str, shards: tuple[int, ...]) -> None:
        self.epoch = epoch
        self.shards = frozenset(shards) if shards else None
        self.started = time.time()
        self.where = f"{socket.gethostname()}:{os.getpid()}"
        self.granted = False
        self.denied: list[Claim] | None = None  # set with the first verdict
        self.verdicts = threading.Event()

    def metadata(self, topics: Any) -> ConsumerProtocolSubscription:
        me = Claim("", self.epoch, self.shards, self.granted, self.started, self.where)
        return ConsumerProtocolSubscription(self.version, sorted(topics), json.dumps(_encode_claim(me)).encode())

    def assign(self, cluster: Any, members: list[Any]) -> dict[str, ConsumerProtocolAssignment]:
        claims = [_decode_claim(m.member_id, json.loads(m.metadata.user_data or b"{}")) for m in members]
        verdict = judge(claims)
        return {m: ConsumerProtocolAssignment(self.version, [], json.dumps(
            {"denied": [_encode_claim(c) | {"member": c.member} for c in hits]}).encode())
            for m, hits in verdict.items()}

    def on_assignment(self, assignment: Any, generation: int) -> None:
        # runs on kafka-python's network thread: only publish the verdict here
        raw = json.loads(assignment.user_data or b'{"denied": []}')
        denied = [_decode_claim(d.get("member", "?"), d) for d in raw["denied"]]
        self.denied = denied
        self.granted = self.granted or not denied
        self.verdicts.set()


class ShardClaims:
    """A stage process's membership of ``<group_id>.claims`` (see the module docstring).

    A thread of its own polls the group, so a rebalance (a process joining or leaving anywhere)
    completes however long the stage's loop turns take; the loop only reads the latest verdict.
    """

    def __init__(self, cfg: KafkaSettings, stage: str, group_id: str, topics: list[str], epoch: str,
                 shards: tuple[int, ...]) -> None:
        from flywheel.kafka.clients import make_consumer

        self.stage = stage
        self.assignor = ClaimAssignor(epoch, shards)
        self.consumer = make_consumer(cfg, f"{stage}-claims", f"{group_id}.claims",
                                      partition_assignment_strategy=[self.assignor])
        self.consumer.subscribe(topics)
        self._stop = threading.Event()
        # the consumer is used by this thread only, until close() has stopped it
        self._poller = threading.Thread(target=self._poll, name=f"{stage}-claims", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.consumer.poll(timeout_ms=200)  # never returns records: nothing is assigned
            except Exception:  # a broker hiccup must not end the membership for good
                log.exception("%s: polling the claims group failed; retrying", self.stage)
                self._stop.wait(1.0)

    @property
    def state(self) -> str:
        """``granted``, or ``unverified`` while the group has not answered (see :meth:`wait_granted`)."""
        return "granted" if self.assignor.granted else "unverified"

    def wait_granted(self, stop: StopFlag | None = None, timeout_s: float = CLAIM_WAIT_S) -> bool:
        """Block until the group's first verdict; raise :class:`ShardConflict` if denied. False
        when ``stop`` came first: the process is stopping, and processes nothing.

        With no verdict in ``timeout_s`` the process runs anyway, unverified, and logs an error:
        the claims guard against a mistaken deployment and are not part of the exactly-once
        protocol, so a group that cannot answer must not keep a stage down. A verdict that comes
        later still applies (:meth:`check`). The embedded broker can leave a group unable to
        finish a join after some leave patterns (local/broker.py), which is where this bites.
        ``stop`` is looked at every ``STOP_CHECK_S``: a SIGTERM while the broker does not answer
        must not wait out ``timeout_s`` too, or the stop outlasts a supervisor's grace period.
        """
        log.info("%s: waiting for the claims group's verdict (at most %.0fs)", self.stage, timeout_s)
        deadline = time.monotonic() + timeout_s
        while not (stop is not None and stop.is_set()):
            if self.assignor.verdicts.wait(max(0.0, min(STOP_CHECK_S, deadline - time.monotonic()))):
                self.check()
                log.info("%s: shard claim granted (%s)", self.stage, self._mine())
                return True
            if time.monotonic() >= deadline:
                log.error("%s: no verdict from the claims group in %.0fs; running unverified: a process "
                          "with overlapping shards would not be refused until the group answers",
                          self.stage, timeout_s)
                return True
        log.info("%s: stopped while waiting for the claims group's verdict", self.stage)
        return False

    def check(self) -> None:
        """Raise :class:`ShardConflict` when the latest verdict denies this process."""
        denied = self.assignor.denied
        if denied:
            copy = any(c.epoch == self.assignor.epoch for c in denied)
            raise ShardConflict(
                f"{self.stage}: this process, {self._mine()}, collides with "
                + "; ".join(c.describe() for c in denied)
                + ". Each shard must run in exactly one process, with the data_dir that holds its "
                "state: stop one of them (see docs/exactly-once.md, Scaling out)"
                + (". The same store runs on another machine: a copy of this data_dir (give this one "
                   "a fresh data_dir), or this store's last process there, if its volume moved here "
                   "(its claim lapses with its session, kafka.session_timeout_ms: start again then)" if copy else ""))

    def _mine(self) -> str:
        a = self.assignor
        return Claim("", a.epoch, a.shards, a.granted, a.started, a.where).describe()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop polling and leave the claims group, within about twice ``timeout_s`` whatever the
        broker does (a stop must fit a supervisor's grace period: flywheel/stream/runner.py STOP_FLUSH_S)."""
        self._stop.set()
        self._poller.join(timeout=timeout_s)
        self.consumer.close(autocommit=False, timeout_ms=int(timeout_s * 1000))
