"""The ingest stage's stream logic: validate, dedupe, join generations with feedback, close windows.

Join state lives in the stage's SQLite store (ingest/exactly_once.py) so that it commits in the
same transaction as the input offsets and the outbox:

- ``gens``   open generations (raw bytes, window deadline), one row per generation_id;
- ``fbs``    feedback waiting for its generation or for its generation's window to close;
- ``closed`` recently closed generations with the feedback ids they folded, to tell a late
             duplicate (dropped, counted) from late new feedback (dead-lettered ``late_feedback``).

The rules themselves (window deadlines, conflict resolution) are the pure functions in
ingest/join.py. Outputs: one :class:`EpisodeEvent` per generation, emitted when its window closes,
keyed by generation_id; dead letters for everything else. Records must be keyed by their
generation_id (``wrong_key`` otherwise): the join relies on a generation and its feedback sharing
a partition number.
"""

from __future__ import annotations

import json
from typing import Any

from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Gauge

from flywheel.bus import DeadLetters
from flywheel.contracts import (
    ContractError,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings
from ingest.exactly_once import StateStore
from ingest.join import generation_deadline, is_late, orphan_deadline, resolve
from ingest.runner import OutboxSink

SCHEMA = """
CREATE TABLE IF NOT EXISTS gens (gid TEXT PRIMARY KEY, shard INTEGER NOT NULL,
    deadline REAL NOT NULL, raw BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS gens_due ON gens (shard, deadline);
CREATE TABLE IF NOT EXISTS fbs (fid TEXT PRIMARY KEY, gid TEXT NOT NULL, shard INTEGER NOT NULL,
    created REAL NOT NULL, deadline REAL NOT NULL, raw BLOB NOT NULL,
    topic TEXT NOT NULL, part INTEGER NOT NULL, off INTEGER NOT NULL, key BLOB);
CREATE INDEX IF NOT EXISTS fbs_gid ON fbs (gid);
CREATE INDEX IF NOT EXISTS fbs_due ON fbs (shard, deadline);
CREATE TABLE IF NOT EXISTS closed (gid TEXT PRIMARY KEY, shard INTEGER NOT NULL,
    closed_at REAL NOT NULL, fids TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS closed_age ON closed (closed_at);
"""

EPISODES_ARCHIVE = "episodes"


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("ingest_records_total", "Records consumed, by topic kind",
                               ["kind"], registry=registry)
        self.duplicates = Counter("ingest_duplicates_total", "Repeated records folded, by kind",
                                  ["kind"], registry=registry)
        self.episodes = Counter("ingest_episodes_total", "Episodes emitted, by resolved signal",
                                ["signal"], registry=registry)
        self.conflicts = Counter("ingest_conflicts_total", "Episodes whose feedback disagreed",
                                 registry=registry)
        self.window = Gauge("ingest_window_open_records", "Records held in the join window",
                            ["kind"], registry=registry)


class IngestStage:
    """Implements :class:`ingest.runner.Stage` for generations + feedback -> episodes."""

    def __init__(self, cfg: IngestSettings, topics: Topics, store: StateStore,
                 registry: CollectorRegistry) -> None:
        self.cfg, self.topics, self.store, self.db = cfg, topics, store, store.db
        self.sink = OutboxSink(store)
        self.dead = DeadLetters(self.sink, topics.deadletter, "ingest", registry)
        self.m = IngestMetrics(registry)
        self._last_prune = 0.0

    # -- records --------------------------------------------------------------------------
    def process(self, records: list[ConsumerRecord], now: float) -> None:
        for rec in records:
            self.sink.shard = rec.partition
            if rec.topic == self.topics.generations:
                self.m.records.labels("generation").inc()
                self._on_generation(rec)
            else:
                self.m.records.labels("feedback").inc()
                self._on_feedback(rec)

    def _decode(self, cls: type, rec: ConsumerRecord) -> Any:
        try:
            event = decode(cls, rec.value)
        except ContractError as exc:
            self.dead.send_record(rec, exc.reason, exc.detail)
            return None
        key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
        if key != event.generation_id:
            self.dead.send_record(rec, "wrong_key",
                                  f"key {key!r} is not the generation_id {event.generation_id!r}")
            return None
        return event

    def _on_generation(self, rec: ConsumerRecord) -> None:
        g: GenerationEvent | None = self._decode(GenerationEvent, rec)
        if g is None:
            return
        gid = g.generation_id
        if self.db.execute("SELECT 1 FROM gens WHERE gid=? UNION ALL SELECT 1 FROM closed WHERE gid=?",
                           (gid, gid)).fetchone():
            self.m.duplicates.labels("generation").inc()
            return
        deadline = generation_deadline(g.completed_at, self.cfg.window_s)
        self.db.execute("INSERT INTO gens VALUES (?, ?, ?, ?)", (gid, rec.partition, deadline, rec.value))
        early = self.db.execute(
            "SELECT fid, created, raw, topic, part, off, key FROM fbs WHERE gid=?", (gid,)).fetchall()
        for fid, created, raw, topic, part, off, key in early:
            if is_late(created, deadline):
                self.db.execute("DELETE FROM fbs WHERE fid=?", (fid,))
                self.dead.send("late_feedback", f"created {created - deadline:.3f}s after the window",
                               source_topic=topic, value=raw, key=key, partition=part, offset=off)

    def _on_feedback(self, rec: ConsumerRecord) -> None:
        f: FeedbackEvent | None = self._decode(FeedbackEvent, rec)
        if f is None:
            return
        closed = self.db.execute("SELECT fids FROM closed WHERE gid=?", (f.generation_id,)).fetchone()
        if closed is not None:
            if f.feedback_id in json.loads(closed[0]):
                self.m.duplicates.labels("feedback").inc()
            else:
                self.dead.send_record(rec, "late_feedback", "generation's window already closed")
            return
        if self.db.execute("SELECT 1 FROM fbs WHERE fid=?", (f.feedback_id,)).fetchone():
            self.m.duplicates.labels("feedback").inc()
            return
        gen = self.db.execute("SELECT deadline FROM gens WHERE gid=?", (f.generation_id,)).fetchone()
        if gen is not None and is_late(f.created_at, gen[0]):
            self.dead.send_record(rec, "late_feedback", f"created {f.created_at - gen[0]:.3f}s after the window")
            return
        self.db.execute(
            "INSERT INTO fbs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (f.feedback_id, f.generation_id, rec.partition, f.created_at,
             orphan_deadline(f.created_at, self.cfg.window_s), rec.value,
             rec.topic, rec.partition, rec.offset, rec.key),
        )

    # -- windows --------------------------------------------------------------------------
    def tick(self, shards: set[int], now: float) -> None:
        cutoff = now - self.cfg.grace_s
        for shard in sorted(shards):
            self.sink.shard = shard
            due = self.db.execute(
                "SELECT gid, raw FROM gens WHERE shard=? AND deadline<?", (shard, cutoff)).fetchall()
            for gid, raw in due:
                self._close(shard, gid, raw, now)
            self._orphans(shard, cutoff)
        if now - self._last_prune > 10:
            self._last_prune = now
            self.db.execute("DELETE FROM closed WHERE closed_at<?", (now - self.cfg.closed_retention_s,))
            for kind, table in (("generation", "gens"), ("feedback", "fbs")):
                self.m.window.labels(kind).set(self.db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def _close(self, shard: int, gid: str, raw: bytes, now: float) -> None:
        fb_raw = self.db.execute("SELECT raw FROM fbs WHERE gid=?", (gid,)).fetchall()
        feedback = [FeedbackEvent.model_validate_json(r[0]) for r in fb_raw]
        res = resolve(feedback)
        episode = EpisodeEvent(
            generation=GenerationEvent.model_validate_json(raw),
            signal=res.signal,
            edited_text=res.edited_text,
            decision_ms=res.decision_ms,
            feedback_ids=res.feedback_ids,
            timed_out=res.timed_out,
            conflicted=res.conflicted,
            resolved_at=now,
        )
        self.store.append(shard, self.topics.episodes, gid, encode(episode), archive=EPISODES_ARCHIVE)
        self.db.execute("INSERT INTO closed VALUES (?, ?, ?, ?)", (gid, shard, now, json.dumps(res.feedback_ids)))
        self.db.execute("DELETE FROM gens WHERE gid=?", (gid,))
        self.db.execute("DELETE FROM fbs WHERE gid=?", (gid,))
        self.m.episodes.labels(res.signal).inc()
        if res.conflicted:
            self.m.conflicts.inc()

    def _orphans(self, shard: int, cutoff: float) -> None:
        rows = self.db.execute(
            "SELECT fid, gid, raw, topic, part, off, key FROM fbs f WHERE shard=? AND deadline<? "
            "AND NOT EXISTS (SELECT 1 FROM gens g WHERE g.gid=f.gid)", (shard, cutoff)).fetchall()
        for fid, gid, raw, topic, part, off, key in rows:
            self.db.execute("DELETE FROM fbs WHERE fid=?", (fid,))
            self.dead.send("orphan_feedback", f"generation {gid} never arrived",
                           source_topic=topic, value=raw, key=key, partition=part, offset=off)
