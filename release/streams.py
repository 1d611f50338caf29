"""The release controller's Kafka side: what it reads (checkpoints; episodes and rewards for the
canary) and what it writes (routing revisions on ``flywheel.releases``, dead letters).

- Checkpoints are read in the consumer group ``release.group_id`` and each batch's offsets are
  committed once the controller has stored its candidates: at least once, and a
  version it knows is a no-op. A record that is not a valid ``CheckpointEvent``, or (with
  ``release.trusted_checkpoint_keys``) not signed by a trusted trainer key, is dead-lettered with
  the reason (``unsigned``, ``bad_signature``, ``unknown_key``: flywheel/signing.py).
- Episodes and rewards are read without a group, from the offsets saved with the canary's tally
  (release/measure.py), at most ``MAX_READ`` records a turn so a backlog does not stall the loop.
  As a canary starts, the episodes of ``release.known_users_lookback_s`` before its start offsets
  are read once for their users (:meth:`Streams.known_users`): who was seen before it started.
- Serving's reports (``flywheel.serving-status``: what each instance applied or refused) are read
  without a group, from the offsets the store saved, at most ``MAX_STATUSES`` a turn; the
  controller acts on them (release/serving_state.py) and then saves the new offsets.
- Revisions are sent keyed by the deployment, signed with ``release.signing_key`` (serving
  verifies them), and counted published only once Kafka acked them; the store keeps the rest
  for the next turn. The current routing is sent again (:meth:`Streams.announce`) at the
  lease's take and every ``release.reannounce_s``: releases are level-triggered. A canary's
  revisions carry its salt (:func:`canary_salt`), which picks the canary's users.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from flywheel.contracts import (
    CONTRACT_REASONS,
    MAX_EPISODE_BYTES,
    CheckpointEvent,
    ContractError,
    EpisodeEvent,
    ReleaseEvent,
    RewardEvent,
    ServingStatusEvent,
    Topics,
    VersionRef,
    decode,
    encode,
)
from flywheel.kafka.clients import (
    high_watermarks,
    make_consumer,
    make_producer,
    partitions_of,
)
from flywheel.kafka.ends import readable_end
from flywheel.kafka.producers import KafkaSink
from flywheel.kafka.topics import ensure_declared
from flywheel.settings import Settings
from flywheel.signing import REFUSALS, RELEASE_CHECKPOINT, Signer, Verifier
from flywheel.stream.deadletters import DeadLetters
from release.measure import Tally
from release.outcomes import MAX_KNOWN, most_recent
from release.store import Revision

log = logging.getLogger(__name__)

#: A read that reached the topics' ends closes the windows due ``CLOSE_LAG_S`` plus one turn
#: (``release.tick_s``) before it began: the ends it compares with come from its fetches, and one
#: may have been sent during the turn before and answered up to ``fetch_max_wait_ms`` (500 ms) later.
CLOSE_LAG_S = 0.5
#: Most episode and reward records folded into a canary's tally per turn.
MAX_READ = 20_000
#: Most serving status records read per turn: one per release per serving instance, so a turn
#: takes a fleet's reports of several releases at once.
MAX_STATUSES = 1000
DEADLETTER_REASONS = tuple(dict.fromkeys((*CONTRACT_REASONS, "too_large", *REFUSALS)))


def signing_report(verifier: Verifier, signer: Signer) -> dict[str, Any]:
    """Whether checkpoint announcements are verified (with which keys, and which key files were
    refused), and the key id routings are signed with (None: unsigned): ``/api/status``'s
    ``controller.signing``, which the console shows."""
    return {"checkpoints": verifier.state().as_dict(), "releases_signed_with": signer.key_id}


class Streams:
    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        self.settings, self.kafka = settings, settings.kafka
        # the trainer's key vouches for a checkpoint, this controller's for a routing (flywheel/signing.py),
        # read first: a key that cannot be used stops the start before any client connects
        self.verifier = Verifier.load(settings.release.trusted_checkpoint_keys,
                                      setting="release.trusted_checkpoint_keys")
        # release_checkpoint_signatures_verified, _trusted_keys, _key_files_refused on /metrics
        self.verifier.register(registry, RELEASE_CHECKPOINT)
        self.signer = Signer.load(settings.release.signing_key, setting="release.signing_key")
        self.topics = Topics(settings.topic_prefix)
        ensure_declared(self.kafka, self.topics)  # as flywheel/topology.py declares them
        self.checkpoints = make_consumer(self.kafka, "release", settings.release.group_id, [self.topics.checkpoints])
        self._uncommitted = False
        self.reader = make_consumer(self.kafka, "release-measure", None)
        self.measured = [self.topics.episodes, self.topics.rewards]
        # Serving's reports are read by assignment, in no consumer group, from offsets the store
        # keeps. Why not a second consumer in the controller's group (the attempt that stalled
        # the checkpoints): a rebalance completes only once every member has joined, and
        # kafka-python drives a member's join only inside that member's own poll. This one thread
        # polls its consumers in turn, so while one waits in its poll for the join to be answered
        # (the embedded broker holds it for half the session timeout; new_checkpoints polls
        # through the whole hold) the other cannot join, and the answer each needs never comes
        # while it polls. Measured on the embedded broker, a turn polling the checkpoint consumer
        # as new_checkpoints does and a second member of its group for 100 ms: with the second
        # one polled first, the checkpoint consumer was never assigned in 11 turns, each turn
        # 10 s, no checkpoint read; with it polled first, it kept its partition but the second
        # member was never assigned in 40 turns. A group of its own is no cure: polled 100 ms a
        # turn, it was not assigned in 6 turns either (its join is held 5 s), and polling through
        # the hold costs every turn at every start and rebalance. Nothing here needs a group: one
        # controller acts at a time (the lease), and the offsets are saved in the store after the
        # actions they lead to, as the canary's measurement saves its own.
        # An empty fetch is answered at once (5 ms, not 500), and a turn with no report waits for
        # one round trip, not a whole poll: kafka-python's poll waits out its timeout when what
        # comes back is empty, and this read runs every turn.
        self.status_reader = make_consumer(self.kafka, "release-serving-status", None, fetch_max_wait_ms=5)
        self.producer = make_producer(self.kafka, "release", max_block_ms=5000)
        self.sink = KafkaSink(lambda: make_producer(self.kafka, "release-deadletters", max_block_ms=5000))
        self.dead = DeadLetters(self.sink, self.topics.deadletter, "release", registry, DEADLETTER_REASONS)

    def signing(self) -> dict[str, Any]:
        return signing_report(self.verifier, self.signer)

    def close(self) -> None:
        self.sink.close()
        self.producer.close(timeout=5)
        self.reader.close()
        self.status_reader.close()
        self.checkpoints.close(autocommit=False)

    # -- checkpoints ------------------------------------------------------------------------
    def new_checkpoints(self, timeout_ms: int = 100) -> list[dict[str, Any]]:
        """Valid checkpoint events that arrived since the last call, as dicts. Their offsets are
        committed by :meth:`commit_checkpoints` once the caller has stored them; a turn that
        fails before that reads them again (a known version is a no-op)."""
        out = []
        if not self.checkpoints.assignment():
            # not in its group yet. A broker may hold the join for half the session timeout (the
            # embedded one does), and here a join answered while no poll ran never completed:
            # with 100 ms polls a tick apart the controller saw no checkpoint at all. So poll
            # through the whole hold, within half the lease so the turn never outlasts it
            timeout_ms = max(timeout_ms, min(self.kafka.session_timeout_ms,
                                             int(self.settings.release.lease_ttl_s * 1000 / 2)))
        for recs in self.checkpoints.poll(timeout_ms=timeout_ms).values():
            for rec in recs:
                try:
                    self.verifier.check(rec.value, rec.headers)  # before anything reads what it says
                    out.append(decode(CheckpointEvent, rec.value).model_dump(mode="json"))
                except ContractError as exc:
                    self.dead.send_record(rec, exc.reason, exc.detail)
                self._uncommitted = True
        return out

    def commit_checkpoints(self) -> None:
        if self._uncommitted:
            if not self.sink.settle(10.0):  # the letters are acked before their offsets are committed
                raise TimeoutError("dead letters of checkpoint records not acked yet")
            self.checkpoints.commit()
            self._uncommitted = False

    # -- serving's reports -------------------------------------------------------------------
    def serving_statuses(self, offsets: dict[int, int] | None, deployment: str,
                         timeout_s: float = 2.0) -> tuple[list[ServingStatusEvent], dict[int, int]]:
        """The deployment's status records after ``offsets`` (None: from the topic's beginning;
        every rule acting on one reads the store's present state, so an old one acts on nothing),
        and the offsets after them, to save once they were acted on. A record that is not a
        valid ``ServingStatusEvent`` is dead-lettered with the reason, and settled before the
        caller saves an offset past it."""
        topic = self.topics.serving_status
        tps = [TopicPartition(topic, p) for p in sorted(partitions_of(self.status_reader, topic))]
        if set(self.status_reader.assignment()) != set(tps):
            self.status_reader.assign(tps)
        after = dict(offsets or {})
        for tp in tps:
            # only where the reader is not already there: a seek drops what it has fetched ahead
            want = after.get(tp.partition, 0)
            if self.status_reader.position(tp, timeout_ms=5000) != want:
                self.status_reader.seek(tp, want)
        # to the partitions' ends as the turn finds them: a report acked before the turn is acted
        # on in this turn, not the next one's (a fetch is in flight when the first poll returns)
        out, read, deadline = [], 0, time.monotonic() + timeout_s
        while read < MAX_STATUSES and time.monotonic() < deadline:
            batches = self.status_reader.poll(timeout_ms=20, max_records=MAX_STATUSES - read)
            if not batches:
                if self._caught_up(self.status_reader, tps):
                    break
                continue
            for tp, recs in batches.items():
                for rec in recs:
                    try:
                        status = decode(ServingStatusEvent, rec.value)
                    except ContractError as exc:
                        self.dead.send_record(rec, exc.reason, exc.detail)
                        continue
                    if status.deployment == deployment:
                        out.append(status)
                after[tp.partition] = recs[-1].offset + 1
                read += len(recs)
        if not self.sink.settle(10.0):
            raise TimeoutError("dead letters of serving status records not acked yet")
        return out, after

    # -- measuring --------------------------------------------------------------------------
    def ends(self) -> dict[str, dict[int, int]]:
        tps = [TopicPartition(t, p) for t in self.measured for p in partitions_of(self.reader, t)]
        ends = high_watermarks(self.kafka, tps, client_id=f"{self.kafka.client_id}-release")
        out: dict[str, dict[int, int]] = {}
        for tp, end in ends.items():
            out.setdefault(tp.topic, {})[tp.partition] = end
        return out

    def read_into(self, tally: Tally, timeout_s: float = 0.5) -> int:
        """Fold the episodes and rewards after the tally's offsets into it; returns how many. Once
        the read has reached the topics' ends, the tally's outcome windows due by when it began are
        read (``Tally.close``): every record published before then is folded by then."""
        began = time.time() - CLOSE_LAG_S - self.settings.release.tick_s
        tps = [TopicPartition(t, p) for t in self.measured for p in partitions_of(self.reader, t)]
        if set(self.reader.assignment()) != set(tps):
            self.reader.assign(tps)
        for tp in tps:
            # only where the reader is not already there: a seek drops what it has fetched ahead
            want = tally.offsets.get(tp.topic, {}).get(tp.partition, 0)
            if self.reader.position(tp, timeout_ms=5000) != want:
                self.reader.seek(tp, want)
        read, deadline = 0, time.monotonic() + timeout_s
        while read < MAX_READ and time.monotonic() < deadline:
            batches = self.reader.poll(timeout_ms=100, max_records=5000)
            if not batches:
                if self._caught_up(self.reader, tps):
                    break
                continue
            for tp, recs in batches.items():
                for rec in recs:
                    self._fold(tally, tp.topic, rec.value)
                tally.offsets.setdefault(tp.topic, {})[tp.partition] = recs[-1].offset + 1
                read += len(recs)
        if self._caught_up(self.reader, tps):
            tally.close(began)
        return read

    def known_users(self, until: dict[int, int], lookback_s: float, started_at: float, stall_s: float = 10.0,
                    keep: Callable[[], None] = lambda: None, keep_every_s: float = 5.0) -> list[str]:
        """The users of the episodes written in the ``lookback_s`` before the episodes offsets
        ``until`` (where a canary's tally starts reading) whose answer was made before
        ``started_at``, the ``MAX_KNOWN`` seen last, oldest first: the users seen before the
        canary started (release/outcomes.py, "New users"). The
        tally alone would know only those whose pre-start episodes come after its start offsets,
        about the last ``ingest.window_s`` of traffic: nearly every user would count as new.

        From ``offsets_for_times`` (what retention left, at most: flywheel/topology.py), and
        records stamped before the lookback are skipped too: a broker that answers the first
        offset for any time (the embedded one does) still reads only the lookback. Raises when
        the broker does not answer or no record comes for ``stall_s``: the caller starts no
        canary without them and tries again next turn. ``keep`` is called every ``keep_every_s``
        while it reads (the controller renews its lease: a week of episodes can take minutes)."""
        since_ms = int((time.time() - lookback_s) * 1000)
        ends = {TopicPartition(self.topics.episodes, p): end for p, end in until.items() if end > 0}
        if not ends:
            return []
        # a reader of its own: the measuring reader keeps its positions and what it fetched ahead
        reader = make_consumer(self.kafka, "release-known-users", None)
        try:
            found = reader.offsets_for_times({tp: since_ms for tp in ends})
            first = reader.beginning_offsets(list(ends))
            starts = {tp: max(hit.offset, first[tp]) for tp, hit in found.items() if hit is not None}
            left = {tp for tp, start in starts.items() if start < ends[tp]}  # None: nothing that recent
            reader.assign(list(left))
            for tp in left:
                reader.seek(tp, starts[tp])
            last_seen: dict[str, float] = {}
            moved = kept = time.monotonic()
            while left:
                if time.monotonic() - kept > keep_every_s:
                    keep()
                    kept = time.monotonic()
                batches = reader.poll(timeout_ms=100, max_records=5000)
                for tp, recs in batches.items():
                    for rec in recs:
                        if rec.offset < ends[tp] and rec.timestamp >= since_ms:
                            user = self._user_of(rec.value, started_at)
                            if user is not None:
                                last_seen[user] = max(last_seen.get(user, 0), rec.timestamp)
                    moved = time.monotonic()
                if len(last_seen) > 2 * MAX_KNOWN:  # bounded memory: only the most recent are kept
                    last_seen = {u: last_seen[u] for u in most_recent(last_seen)}
                for tp in list(left):
                    # done at the start offsets, or at what is readable when nothing came: records
                    # of a transaction still open at the start are left out, not waited for
                    pos, readable = reader.position(tp, timeout_ms=5000), readable_end(reader, tp)
                    if pos >= ends[tp] or (not batches and readable is not None and pos >= readable):
                        left.discard(tp)
                        reader.pause(tp)
                if left and time.monotonic() - moved > stall_s:
                    raise TimeoutError(f"no episode read for {stall_s:.0f} s while reading the users seen before "
                                       f"the canary ({len(last_seen)} so far)")
            return most_recent(last_seen)
        finally:
            reader.close()

    def _user_of(self, value: bytes | None, before: float) -> str | None:
        """The user an episode's answer was made for (the id the tally's windows use) if it was
        made before ``before``; None for pinned evaluation traffic (no user's arm, as the fold
        skips it), a later answer (a tally made a turn after its canary started reads to later
        offsets: their users are not from before it) or a record it cannot read."""
        try:
            g = decode(EpisodeEvent, value, max_bytes=MAX_EPISODE_BYTES).generation
        except ContractError:
            return None  # ingest's to dead-letter; the fold skips it the same way
        return None if g.route == "pinned" or g.created_at >= before else g.user_id

    @staticmethod
    def _caught_up(reader: Any, tps: list[TopicPartition]) -> bool:
        for tp in tps:
            # the last stable offset: ingest and reward write in transactions, and one is open
            # most of the time, so the high watermark is seldom reached (flywheel/kafka/ends.py)
            end = readable_end(reader, tp)
            if end is None or reader.position(tp, timeout_ms=1000) < end:
                return False
        return True

    def _fold(self, tally: Tally, topic: str, value: bytes | None) -> None:
        # Ingest and reward validated these at their edges; a record this reader cannot use is
        # theirs to dead-letter, not a measurement (it is skipped and counted in the log).
        # Decoded through the contract, as those stages wrote them: a renamed field fails here,
        # loudly, instead of reading as absent and zeroing a guardrail's count.
        try:
            if topic == self.topics.episodes:
                tally.add_episode(decode(EpisodeEvent, value, max_bytes=MAX_EPISODE_BYTES))
            else:
                tally.add_reward(decode(RewardEvent, value))
        except ContractError as exc:
            log.warning("skipped an unreadable %s record while measuring: %s", topic, exc)

    # -- routing ----------------------------------------------------------------------------
    def publish(self, revisions: list[Revision], deployment: str,
                ref: Callable[[int], VersionRef | None]) -> list[int]:
        """Send ``revisions`` in order, each version with ``ref(version)`` (where serving fetches
        it); the ones Kafka acked."""
        done = []
        for rev in revisions:
            try:
                event = release_event(rev, deployment, ref)
            except ValidationError as exc:
                # the controller skips these before (Controller._publish); should one get here, it
                # must not hold back the revisions after it, a rollback among them
                log.error("revision %d cannot be published: %s", rev.revision, exc)
                continue
            try:
                self._send(event)
            except Exception as exc:  # noqa: BLE001 - the broker did not ack: kept for the next turn
                log.warning("revision %d not published yet: %s", rev.revision, exc)
                break
            done.append(rev.revision)
            log.info("published revision %d: stable v%d, canary %s at %.0f%% (%s)", rev.revision, rev.stable_version,
                     f"v{rev.canary_version}" if rev.canary_version is not None else "none", 100 * rev.canary_share,
                     rev.reason)
        return done

    def announce(self, rev: Revision, deployment: str, ref: Callable[[int], VersionRef | None]) -> bool:
        """Send the record of ``rev``, a routing already published (or revision 0), again: the
        same revision, so a serving that applied it skips it as a repeat. Whether Kafka acked it."""
        try:
            self._send(release_event(rev, deployment, ref))
        except Exception as exc:  # noqa: BLE001 - not acked, or no longer buildable: the controller tries again
            log.warning("routing revision %d not announced again: %r", rev.revision, exc)
            return False
        log.debug("announced routing revision %d again", rev.revision)
        return True

    def _send(self, event: ReleaseEvent) -> None:
        """One release record, signed, keyed by its deployment (the key a compacted topic keeps the
        newest record of), waited for until Kafka acks it."""
        value = encode(event)
        self.producer.send(self.topics.releases, key=event.deployment, value=value,
                           headers=self.signer.headers(value)).get(timeout=10)


def release_event(rev: Revision, deployment: str, ref: Callable[[int], VersionRef | None]) -> ReleaseEvent:
    """The record of one routing revision, each version with ``ref(version)``. ``ValidationError``
    when the store's rows cannot make one (a version unknown, or its uri or hash one the contract
    refuses): the same rows give the same error every turn."""
    canary = rev.canary_version
    canary_ref = ref(canary) if canary else None
    return ReleaseEvent(revision=rev.revision, deployment=deployment, stable_version=rev.stable_version,
                        canary_version=canary, canary_share=rev.canary_share,
                        canary_salt=canary_salt(deployment, canary_ref) if canary_ref else "",
                        stable_ref=ref(rev.stable_version) if rev.stable_version else None,
                        canary_ref=canary_ref, reason=rev.reason, updated_at=rev.at)


def canary_salt(deployment: str, canary: VersionRef) -> str:
    """The salt of the hash that splits users for this canary (serving/routing.py): the same for
    every revision of one canary, so a user keeps their version while it runs, and another for
    the next canary, so each draws a fresh split. The manifest hash tells apart two versions
    given one number (a checkpoint store started afresh). Not a secret: which version a user got
    is in every answer anyway."""
    return f"{deployment}/v{canary.version}/{canary.manifest_sha256[:16]}"
