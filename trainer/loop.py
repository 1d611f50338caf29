"""The continuous trainer: rewards topic -> batches -> DeepSpeed steps -> published versions.

Rank 0 (the leader) owns the Kafka consumer, the dead-letter producer and the checkpoint store.
Each loop turn it decides one command - ``train`` (with the batch), ``publish``, ``idle`` or
``stop`` - and broadcasts it, so every rank takes the same optimizer steps on its shard of the
batch (whole groups per rank) and joins every DeepSpeed checkpoint save.

Exactly-once, in effect (docs/trainer.md has the full argument): a version's manifest stores the
data offsets whose effect it contains (:class:`~trainer.batching.OffsetBook`), and it becomes
durable by an atomic rename. A restart loads the newest version's DeepSpeed checkpoint and seeks
every partition to its stored floor, skipping offsets listed as already settled above it. Work
done after the last durable version died with the process, so training it again is its first
effect. Group commits happen after a version is durable and serve lag monitoring only, and a
rebalance never moves a partition back to them (:class:`_Seek`).

A broker that does not answer stops nothing but the data: the loop trains what it has fetched,
and a version that settles offsets of dead-lettered records is committed only once Kafka has
acked those letters (a commit before would lose them in a crash). Announcements follow versions
as the broker allows (trainer/announce.py). ``trainer_stalled_seconds`` says how long records
have been owed to Kafka with no ack, or the checkpoint store has been out of reach.

A checkpoint store out of reach (a mode taken away, a network filesystem that does not answer)
stops nothing but the versions: a publish that fails leaves nothing visible and is tried again
with backoff (trainer/outage.py), no group offset is committed for work that is in no version, and
training waits while the version it owes cannot be written, so a version still holds
``publish_every_steps`` of work. Announcements wait for the store as well. A start waits for it up
to :data:`~trainer.outage.START_WAIT_S`; errors that say the store is broken, not away, fail as before.

In LoRA mode (``trainer.lora_rank`` above 0) every version is an adapter on ``model_dir``, whose
manifest hash each version records: the trainer refuses to start on a base that is not the one
the store's versions were trained on, or on a store of the other kind (docs/trainer.md, "LoRA").
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kafka import ConsumerRebalanceListener, OffsetAndMetadata, TopicPartition
from safetensors.torch import save_file

from flywheel.checkpoints import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    WEIGHTS,
    Adapter,
    CheckpointStore,
    adapter_of,
)
from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError, sha256_file, verify_dir
from flywheel.contracts import (
    ContractError,
    RewardEvent,
    Topics,
    decode,
    encode,
)
from flywheel.kafka.batches import unreadable_batch
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.producers import KafkaSink
from flywheel.probes import Heartbeat
from flywheel.settings import Settings
from flywheel.signing import Signer
from flywheel.stream.deadletters import DeadLetters
from flywheel.telemetry import request_id_of
from trainer import dist
from trainer.announce import announced, checkpoint_event, mark_announced
from trainer.batching import Batcher, OffsetBook, Sample, is_stale, reject_reason
from trainer.losses import GROUPED
from trainer.metrics import TrainerMetrics
from trainer.outage import OUT, StoreOutage
from trainer.policy import Policy

log = logging.getLogger(__name__)

#: How long a stop waits for Kafka to ack what it is owed (dead letters, announcements).
STOP_WAIT_S = 5.0
#: Longest sleep of a loop turn that waits for the store: the heartbeat and the acks go on meanwhile.
IDLE_WAIT_S = 0.2


@dataclass
class Ledger:
    """What the next version will contain: trained ids and declared drops (written as ledger.json)."""

    trained: list[str] = field(default_factory=list)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    #: generation_id -> the id of the request that made it, for the trained samples whose reward
    #: record carried one (flywheel/telemetry.py): from a user's request to the version it is in
    requests: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    #: Tokens of the trained samples (``flywheel usage``): prompt and completion, each sample's own.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: monotonic time of its first entry: ``publish_every_s`` counts from there, so a version
    #: published after an idle spell holds that many seconds of work, not the first batch's
    since: float | None = None

    def touch(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def drop(self, reason: str, gid: str) -> None:
        self.touch()
        self.dropped.setdefault(reason, []).append(gid)

    def empty(self) -> bool:
        return not self.trained and not self.dropped

    def to_json(self) -> dict[str, Any]:
        return {"trained": self.trained, "dropped": self.dropped, "requests": self.requests, "steps": self.steps,
                "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens}}


def publish_due(ledger: Ledger, now: float, every_steps: int, every_s: float) -> bool:
    """A version is due after ``every_steps`` steps, or ``every_s`` after the ledger's first entry
    (a step or a declared drop): never for an empty ledger, and an idle spell before the first
    entry does not count, so a version published on time holds that long of work."""
    if ledger.steps >= every_steps:
        return True
    return ledger.since is not None and now - ledger.since >= every_s


class _Seek(ConsumerRebalanceListener):
    """On assignment, position each partition where the trainer's own book says, never where the
    group's committed offset does.

    At the start that is the floor of the latest durable version. A rebalance while the trainer
    runs (its session evicted after a long step, another consumer with its group id joining or
    leaving) takes partitions away and gives them back: they resume after the last record this
    process took in, since everything up to it is settled or waits in the batcher (and
    :meth:`Trainer._intake` ignores such a record if it comes again). A partition with neither
    is positioned by the group (its committed offset, else the earliest); :meth:`Trainer._poll`
    records that start as its floor before the partition can be taken away, for another member
    may read and commit past records there that this trainer still has to train.

    kafka-python calls these from inside ``poll`` on its I/O thread while the loop waits in it:
    they only seek (no network) and note what the loop must do after ``poll`` returns.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.trainer.unstarted.difference_update(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        for tp in assigned:
            at = self.trainer.book.resume_at(tp.topic, tp.partition)
            if at is not None:
                self.trainer.consumer.seek(tp, at)
            else:
                self.trainer.unstarted.add(tp)


class Trainer:
    def __init__(
        self,
        settings: Settings,
        policy: Policy,
        store: CheckpointStore,
        metrics: TrainerMetrics,
        *,
        rank: int = 0,
        world: int = 1,
        consumer: Any = None,
        sink: KafkaSink | None = None,
        deadletters: DeadLetters | None = None,
        lag: LagGauge | None = None,
    ) -> None:
        self.s, self.cfg = settings, settings.trainer
        self.policy, self.store, self.m = policy, store, metrics
        self.rank, self.world = rank, world
        self.consumer, self.sink, self.deadletters, self.lag = consumer, sink, deadletters, lag
        self.topics = Topics(settings.topic_prefix)
        grouped = self.cfg.loss in GROUPED
        self.batcher = Batcher(self.cfg.batch_size, grouped, self.cfg.group_size, self.cfg.active_sampling)
        self.book = OffsetBook()
        self.ledger = Ledger()
        self.version = -1
        self.step = 0
        self.samples = 0
        self.seen_ids: set[str] = set()
        # generation_id -> request id of the samples taken in and not yet trained or dropped (rank 0)
        self.request_ids: dict[str, str] = {}
        # assigned partitions the book has no floor for yet: their start is recorded after a poll (_Seek)
        self.unstarted: set[TopicPartition] = set()
        self.last_stats: dict[str, float] = {}
        self.stop_event = threading.Event()
        self.vocab = int(policy.module.config.vocab_size)
        # announcements (rank 0): versions committed but not yet written to the sink, the
        # highest written, and the highest through which every one was acked (trainer/announce.py)
        self._owed: list[int] = []
        self._announcing = self._announced = -1
        self._held_since: float | None = None  # monotonic: a due publish waits for acks since then
        # the writer (rank 0) signs its announcements, so the controller can tell them from anyone's
        self.signer = Signer.load(self.cfg.signing_key, setting="trainer.signing_key") if sink is not None else Signer()
        #: the checkpoint store's outage, if it is out of reach (rank 0 counts it; trainer/outage.py)
        self.outage = StoreOutage(store)
        metrics.stalled.set_function(self.stalled_s)
        self.heartbeat = Heartbeat()
        #: the base an adapter version names (LoRA), taken from model_dir at start
        self.base: tuple[str, str] | None = None

    # ------------------------------------------------------------ start / resume
    def start(self) -> None:
        """Resume from the newest durable version, or publish version 0 (the initial model).

        A store out of reach is waited for, up to :data:`~trainer.outage.START_WAIT_S`; each rank
        retries its own reads (DeepSpeed's load has no collective), and version 0's publish is
        retried by all.
        """
        point = self.outage.at_start("reading its versions", self._resume_point) if self.rank == 0 else None
        latest = dist.broadcast(point, self.rank, self.world)
        if latest is None:
            while not self.publish():  # every rank, in step: publish returns rank 0's outcome
                if self.rank == 0:
                    self.outage.start_pause()
            return
        self.outage.at_start(f"restoring version {latest}", lambda: self.policy.restore(self.store.path(latest)))
        man, seen = self.outage.at_start(f"reading version {latest}", lambda: self._resume_state(latest))
        self.version, self.step, self.samples = latest, man.get("step", 0), man.get("samples_total", 0)
        self.book = OffsetBook.from_json(man.get("offsets", {}))
        self.seen_ids.update(seen)
        self.m.version.set(self.version)
        log.info("resumed from version %d (step %d, %d samples)", latest, self.step, self.samples)

    def _resume_point(self) -> int | None:
        """Rank 0: the newest version, checked to be of this trainer's kind; the versions owed an
        announcement since the last run."""
        latest = self._pull_newest()
        self._check_kind(latest)
        if self.sink is not None:
            # versions a previous run committed but could not announce go out first
            self._announcing = self._announced = announced(self.store)
            self._owed = [v for v in self.store.versions() if v > self._announced]
            if self._owed:
                log.info("versions %s were never announced; announcing them now", self._owed)
        return latest

    def _pull_newest(self) -> int | None:
        """The newest version, pulled first from the object store when there is one and the local
        store lacks it (a fresh disk: flywheel/checkpoints/remote.py), optimizer state included.
        A newer local version was committed and not yet published: it is owed, and goes out."""
        local = self.store.latest()
        theirs = self.store.remote.latest() if self.store.remote is not None else None
        if theirs is not None and (local is None or theirs > local):
            self.store.remote.pull(theirs, self.store)
            return theirs
        return local

    def _resume_state(self, latest: int) -> tuple[dict[str, Any], set[str]]:
        """The manifest to resume from, and the recent trained ids (a duplicate record is dropped, not retrained)."""
        seen: set[str] = set()
        held = self.store.versions()
        for v in held[-20:]:
            seen.update(self.store.ledger(v)["trained"])
        if self.store.remote is not None:  # a fresh disk pulled the newest version only
            for v in self.store.remote.versions()[-20:]:
                if v not in held:
                    seen.update(self.store.remote.ledger(v)["trained"])
        return self.store.manifest(latest), seen

    def _check_kind(self, latest: int | None) -> None:
        """In LoRA mode: the model directory is verified, and is the base of the store's versions.
        Either mode: the store's newest version is of this trainer's kind. Raises
        :class:`~flywheel.checkpoints.ManifestError` saying what to change."""
        theirs = adapter_of(self.store.manifest(latest)) if latest is not None else None
        if self.policy.lora is None:
            if theirs is not None:
                raise ManifestError(f"the store's latest version {latest} is a LoRA adapter, and trainer.lora_rank is 0: "
                                    "set the LoRA settings it was trained with, or start a new store")
            return
        model_dir = Path(self.s.model_dir)
        if not (model_dir / MANIFEST_NAME).is_file():
            raise ManifestError(f"LoRA versions name their base by its manifest's hash; {model_dir} has none "
                                "(flywheel model import writes one)")
        verify_dir(model_dir)
        self.base = (model_dir.resolve().name, sha256_file(model_dir / MANIFEST_NAME))
        if latest is None:
            return
        if theirs is None:
            raise ManifestError(f"the store's latest version {latest} holds full weights, and trainer.lora_rank is "
                                f"{self.policy.lora.rank}: LoRA trains on model_dir, so start a new store (to train "
                                "on that version, export it and make it the model directory)")
        if theirs.base_manifest_sha256 != self.base[1]:
            raise ManifestError(f"the store's versions are adapters on base {theirs.base_name!r} (manifest "
                                f"{theirs.base_manifest_sha256[:12]}…); model_dir {model_dir} is another model "
                                f"(manifest {self.base[1][:12]}…)")

    def subscribe(self) -> None:
        self.consumer.subscribe([self.topics.rewards], listener=_Seek(self))

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        """Loop until :attr:`stop_event` is set (leader) or the leader says stop (other ranks)."""
        while True:
            self.heartbeat.beat()  # a turn starts: /livez (flywheel/probes.py)
            cmd = self._decide() if self.rank == 0 else None
            cmd = dist.broadcast(cmd, self.rank, self.world)
            kind, payload = cmd
            if kind == "stop":
                # a graceful stop keeps the work done since the last version, if the store takes it
                if payload and not self.publish() and self.rank == 0:
                    log.warning("stopping without publishing: the checkpoint store is out of reach; the %d steps "
                                "since version %d are trained again after the restart", self.ledger.steps,
                                self.version)
                break
            if kind == "train":
                self._train([RewardEvent.model_validate(e) for e in payload["events"]], payload["pos"])
            elif kind == "publish":
                self.publish()
        if self.rank == 0:
            self._settle_outputs(STOP_WAIT_S)  # the last version's announcement; else the next start's

    def _decide(self) -> tuple[str, Any]:
        settled = self._settle_outputs()
        if self.stop_event.is_set():
            return ("stop", self._publish_at_stop(settled))
        if self._publish_due() and self.outage.waiting():
            # the version owed cannot be written yet: training waits for it, so a version still
            # holds publish_every_steps of work (and a crash meanwhile loses no more than that)
            self.stop_event.wait(min(self.outage.wait_s(), IDLE_WAIT_S))
            return ("idle", None)
        if self._publish_now(settled):
            return ("publish", None)
        batch = self.batcher.next_batch()
        if batch is None:
            self._poll()
            batch = self.batcher.next_batch()
        if batch is None:
            return ("publish", None) if self._publish_now(settled) else ("idle", None)
        return ("train", {"events": [s.event.model_dump(mode="json") for s in batch], "pos": [s.pos for s in batch]})

    def _settle_outputs(self, timeout_s: float = 0.0) -> bool:
        """Whether Kafka has acked everything the trainer wrote to it, waiting up to ``timeout_s``.

        Writes the announcements of versions committed since the last turn first, and moves the
        store's announced mark once they are acked. Both read or write the store: while it is out
        of reach they wait (the versions stay owed, in order; a restart announces them).
        """
        if self.sink is None:
            return True
        if self._owed and not self.outage.waiting():
            self.outage.attempt(f"announcing version {self._owed[0]}", self._announce_owed)
        if not self.sink.settle(timeout_s):
            return False
        if self._announcing > self._announced and not self.outage.waiting():
            mark = self._announcing
            if self.outage.attempt(f"marking version {mark} announced", lambda: mark_announced(self.store, mark)) is not OUT:
                self._announced = mark
        return True

    def _announce_owed(self) -> None:
        self.store.sync()  # a version is announced once its rename is durable
        while self._owed:
            version = self._owed[0]
            value = encode(checkpoint_event(self.store, version))
            self.sink.write(self.topics.checkpoints, str(version), value, headers=self.signer.headers(value))
            self._announcing = self._owed.pop(0)

    def _may_publish(self, settled: bool) -> bool:
        """A due version waits while Kafka has not acked the dead letters whose offsets it would
        settle: committed first, a crash would lose them."""
        if settled:
            if self._held_since is not None:
                log.info("Kafka acked what it was owed after %.0fs; publishing", time.monotonic() - self._held_since)
                self._held_since = None
            return True
        if self._held_since is None:
            self._held_since = time.monotonic()
            log.warning("a version is due, but %d records sent to Kafka are not acked yet; it waits for them "
                        "(training goes on)", self.sink.unacked if self.sink is not None else 0)
        return False

    def _publish_at_stop(self, settled: bool) -> bool:
        """A stop publishes the work since the last version, if Kafka acks what it is owed in time."""
        if self.ledger.empty():
            return False
        if settled or self._settle_outputs(STOP_WAIT_S):
            return True
        log.warning("stopping without publishing: Kafka has not acked %d records; the %d steps since "
                    "version %d are trained again after the restart", self.sink.unacked if self.sink else 0,
                    self.ledger.steps, self.version)
        return False

    def stalled_s(self) -> float:
        """Seconds records have been owed to Kafka with no ack, or the checkpoint store has been
        out of reach, whichever is longer (0 while both are fine)."""
        return max(self.sink.stuck_s() if self.sink is not None else 0.0, self.outage.stalled_s())

    def healthy(self, stale_s: float = 60.0) -> tuple[bool, dict[str, object]]:
        stalled = self.stalled_s()
        return stalled < stale_s, {
            "version": self.version, "step": self.step, "samples": self.samples,
            "stalled_s": round(stalled, 3), "unannounced": len(self._owed) + self._announcing - self._announced}

    def _publish_due(self) -> bool:
        return publish_due(self.ledger, time.monotonic(), self.cfg.publish_every_steps, self.cfg.publish_every_s)

    def _publish_now(self, settled: bool) -> bool:
        return self._publish_due() and not self.outage.waiting() and self._may_publish(settled)

    # ------------------------------------------------------------ intake
    def _poll(self) -> None:
        t0 = time.monotonic()
        polled = self.consumer.poll(timeout_ms=200, max_records=max(256, 4 * self.cfg.batch_size))
        self.m.wait.inc(time.monotonic() - t0)  # time blocked on the broker, not decoding
        for records in polled.values():
            for rec in records:
                self._intake(rec)
        if self.unstarted:
            self._record_starts()
        if self.lag is not None:
            self.lag.update(self.consumer)

    def _record_starts(self) -> None:
        """The floor of each newly assigned partition the book knew nothing of: where the consumer
        starts it (see :class:`_Seek`). Its first record read sets the floor too; else its position
        once the consumer has resolved it, asked without waiting (a later turn asks again)."""
        for tp in list(self.unstarted):
            if (tp.topic, tp.partition) not in self.book.floors:
                at = self.consumer.position(tp, timeout_ms=0)
                if at is None:
                    continue
                self.book.start(tp.topic, tp.partition, at)
            self.unstarted.discard(tp)

    def _intake(self, rec: Any) -> None:
        if self.book.taken(rec.topic, rec.partition, rec.offset):
            # read again after a rebalance: settled already, or waiting in the batcher untrained
            # (not a duplicate: dropping it would settle an offset whose sample is not trained)
            return
        self.book.seen(rec.topic, rec.partition, rec.offset)
        if self.book.is_settled(rec.topic, rec.partition, rec.offset):
            return  # its effect is already in a durable version
        if rec.headers and (marker := unreadable_batch(rec.headers)) is not None:
            self.deadletters.send_unreadable(rec, marker)
            return self._unused(rec, "unreadable_batch")
        try:
            ev = decode(RewardEvent, rec.value)
        except ContractError as exc:
            return self._dead(rec, exc.reason, exc.detail)
        bad = reject_reason(ev, trainer_version=self.version, max_seq_len=self.cfg.max_seq_len, vocab_size=self.vocab)
        if bad is not None:
            return self._dead(rec, *bad)
        if ev.generation_id in self.seen_ids:
            return self._drop(Sample(ev, rec.topic, rec.partition, rec.offset), "duplicate")
        if is_stale(self.version, ev.model_version, self.cfg.max_staleness):
            return self._drop(Sample(ev, rec.topic, rec.partition, rec.offset), "stale")
        self.seen_ids.add(ev.generation_id)
        if (rid := request_id_of(rec.headers)) is not None:
            self.request_ids[ev.generation_id] = rid
        self.m.staleness.observe(self.version - ev.model_version)
        self._evict(self.batcher.add(Sample(ev, rec.topic, rec.partition, rec.offset)))

    def _dead(self, rec: Any, reason: str, detail: str) -> None:
        self.deadletters.send_record(rec, reason, detail)
        self._unused(rec, reason)

    def _unused(self, rec: Any, reason: str) -> None:
        """A dead-lettered record: counted, and its offset settled (nothing of it is trained)."""
        self.m.dropped.labels(reason).inc()
        self.book.settle(rec.topic, rec.partition, rec.offset)
        self.ledger.drop(reason, _key(rec))

    def _evict(self, dropped: list[tuple[Sample, str]]) -> None:
        """Drop samples the batcher held: their request ids go with them (a duplicate's drop, in
        :meth:`_intake`, keeps the id of the original it repeats)."""
        for s, reason in dropped:
            self.request_ids.pop(s.event.generation_id, None)
            self._drop(s, reason)

    def _drop(self, s: Sample, reason: str) -> None:
        self.m.dropped.labels(reason).inc()
        self.book.settle(*s.pos)
        self.ledger.drop(reason, s.event.generation_id)

    # ------------------------------------------------------------ train
    def _shard(self, events: list[RewardEvent]) -> tuple[list[RewardEvent], bool]:
        """This rank's whole groups (round-robin); a rank left without any reuses one at weight 0."""
        groups = list(dict.fromkeys(e.group_id for e in events))
        mine = set(groups[self.rank :: self.world])
        shard = [e for e in events if e.group_id in mine]
        return (shard, True) if shard else (events[:1], False)

    def _train(self, events: list[RewardEvent], pos: list[tuple[str, int, int]]) -> None:
        t0 = time.monotonic()
        shard, real = self._shard(events)
        scale = None if real else (lambda inp, cfg: (inp.logp.sum() * 0.0, {}))
        stats = self.policy.forward_backward(shard, loss_fn=scale)
        if stats.get("nonfinite"):  # no backward ran on any rank: no step either
            if self.rank == 0:
                self._reject_batch(events, pos)
            return
        self.policy.step()
        self.step += 1
        if self.rank != 0:
            return
        dt = time.monotonic() - t0
        self.m.busy.inc(dt)
        self.m.record_step(stats, dt, len(events))
        self.last_stats = stats
        self.samples += len(events)
        self.ledger.touch()
        self.ledger.steps += 1
        for e, p in zip(events, pos):
            self.ledger.trained.append(e.generation_id)
            if (rid := self.request_ids.pop(e.generation_id, None)) is not None:
                self.ledger.requests[e.generation_id] = rid
            self.book.settle(*p)
        prompt, completion = (sum(len(e.prompt_token_ids) for e in events),
                              sum(len(e.completion_token_ids) for e in events))
        self.ledger.prompt_tokens += prompt
        self.ledger.completion_tokens += completion
        self.m.record_trained_tokens(self.version + 1, prompt, completion)  # the version these go into

    def _reject_batch(self, events: list[RewardEvent], pos: list[tuple[str, int, int]]) -> None:
        """Dead-letter a batch whose loss was not finite: none of its records is trained on, and
        each can be replayed once the cause is found (docs/trainer.md, "What is dropped, and why")."""
        log.error("loss of a batch of %d samples is not finite; no step taken, its records are dead letters",
                  len(events))
        for ev, (topic, part, offset) in zip(events, pos):
            if self.deadletters is not None:
                self.deadletters.send("nonfinite_loss", "the loss of this record's batch was not finite",
                                      source_topic=topic, value=encode(ev), key=ev.generation_id.encode(),
                                      partition=part, offset=offset)
            self.m.dropped.labels("nonfinite_loss").inc()
            self.book.settle(topic, part, offset)
            self.ledger.drop("nonfinite_loss", ev.generation_id)
            self.request_ids.pop(ev.generation_id, None)
            # not trained: a replay of it is new, not a duplicate (as after a restart, which
            # rebuilds the seen ids from the versions' trained ids)
            self.seen_ids.discard(ev.generation_id)

    # ------------------------------------------------------------ publish
    def publish(self) -> bool:
        """Every rank saves its DeepSpeed state into the staging dir; rank 0 commits the version.

        False on every rank when the store was out of reach: nothing of the version is visible,
        nothing was announced or committed to the group, its ledger and offsets wait for the next
        try (rank 0 counted the outage in :attr:`outage`).
        """
        t0 = time.monotonic()
        version = self.version + 1
        staged = self.outage.attempt(f"staging version {version}", lambda: str(self.store.staging_dir(version))) \
            if self.rank == 0 else None
        tmp = dist.broadcast(None if staged is OUT else staged, self.rank, self.world)
        if tmp is None:
            return False
        saved = self._save(Path(tmp), version)
        dist.barrier(self.world)
        done = saved and self.rank == 0 and self.outage.attempt(
            f"writing version {version}", lambda: self._commit(Path(tmp), version)) is True
        if not dist.broadcast(done if self.rank == 0 else None, self.rank, self.world):
            if self.rank == 0:  # never visible; what this cannot delete, the next commit's prune does
                shutil.rmtree(tmp, ignore_errors=True)
            return False
        self.version = version
        dist.barrier(self.world)
        self._evict(self.batcher.evict_stale(self.version, self.cfg.max_staleness))
        self.m.publish_time.observe(time.monotonic() - t0)
        self.m.busy.inc(time.monotonic() - t0)
        return True

    def _save(self, tmp: Path, version: int) -> bool:
        """This rank's DeepSpeed state into ``tmp``; False when the store went out of reach meanwhile.
        With several ranks a failed save is raised: the others wait in DeepSpeed's own barrier,
        which one rank cannot leave (docs/trainer.md, "When the checkpoint store is out of reach")."""
        try:
            self.policy.save(tmp, client_state={"version": version, "step": self.step})
        except Exception as exc:
            if self.world > 1 or (err := self.store.out_of_reach(exc)) is None:
                raise
            self.outage.failed(f"saving version {version}'s DeepSpeed state", err)
            return False
        return True

    def _commit(self, tmp: Path, version: int) -> bool:
        dtype = served_dtype(self.cfg.served_dtype, self.s.model_dir)
        adapter = self._stage_adapter(tmp, dtype) if self.policy.lora is not None else None
        if adapter is None:
            save_file(self.policy.publish_weights(dtype), str(tmp / WEIGHTS), metadata={"format": "pt"})
            _write_config(self.s.model_dir, tmp, dtype)
        parent = self.version if self.version >= 0 else None
        extra = {
            "step": self.step,
            "samples": len(self.ledger.trained),
            "samples_total": self.samples,
            # JSON has no NaN: one would be written as null and break the checkpoint's contract
            "metrics": {k: float(v) for k, v in self.last_stats.items() if math.isfinite(v)},
            "offsets": self.book.to_json(),
        }
        _, man = self.store.commit(tmp, version=version, parent=parent, source_dir=self.s.model_dir, extra=extra,
                                   ledger=self.ledger.to_json(), adapter=adapter)
        self._owed.append(version)  # announced from the next loop turn on
        self.m.version.set(version)
        if "delta_bytes" in man:
            self.m.delta_bytes.set(man["delta_bytes"])
            self.m.delta_ratio.set(man["delta_ratio"])
        self._commit_offsets()
        self.ledger = Ledger()
        log.info("published version %d (step %d, %d samples, %s)", version, self.step, extra["samples"], "full" if man["full_snapshot"] else f"delta {man.get('delta_ratio', 0):.1f}x")
        return True

    def _stage_adapter(self, tmp: Path, dtype: torch.dtype) -> Adapter:
        """Write the adapter (PEFT's two files) into ``tmp``; what its manifest says of it."""
        assert self.base is not None and self.policy.lora is not None  # set by start (_check_kind)
        save_file(self.policy.publish_weights(dtype), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = self.policy.adapter_config(self.base[0])
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        return Adapter(self.base[0], self.base[1], self.policy.lora.rank, self.policy.lora.alpha,
                       tuple(config["target_modules"]))

    def _commit_offsets(self) -> None:
        """Commit the durable floors to the group: for lag monitoring only (restarts resume from
        the manifest's offsets), so asynchronously, never waiting on the broker."""
        if self.consumer is not None:
            offsets = {TopicPartition(t, p): OffsetAndMetadata(f, "", -1) for (t, p), f in self.book.floors.items()}
            try:
                self.consumer.commit_async(offsets)
            except Exception as exc:  # noqa: BLE001 - a rebalance in progress; the next version commits again
                log.warning("offset commit for monitoring failed: %s", exc)


def _key(rec: Any) -> str:
    return rec.key.decode("utf-8", "replace") if rec.key else f"{rec.topic}:{rec.partition}:{rec.offset}"


def served_dtype(name: str, model_dir: Path) -> torch.dtype:
    """``auto``: the dtype the model directory's config declares (what serving loads)."""
    if name == "auto":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, name)


def _write_config(model_dir: Path, dest: Path, dtype: torch.dtype) -> None:
    """Copy config.json with its dtype set to the published weights' dtype."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = name
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
