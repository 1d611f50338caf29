"""The ingest stage's stream logic: validate, dedupe, join generations with feedback, close windows.

Join state lives in the stage's state store (flywheel/stream/store.py) so that it commits in the
same transaction as the input offsets and the outbox. Every row carries its shard (the input
partition number): a store shared by several replicas holds every shard, and each replica reads
and changes the rows of its own (``store.scoped()``; a generation id's rows are its shard's):

- ``gens``   open generations (canonical bytes, window deadline, when the window closes, source
             offset, and the request id and trace context its record carried, which its episode
             carries on: flywheel/telemetry.py), one row per generation_id;
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
import math
from collections.abc import Iterator
from typing import Any

import msgspec
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Gauge

from flywheel.contracts import (
    MAX_EPISODE_BYTES,
    MAX_FEEDBACK_BYTES,
    MAX_RECORD_BYTES,
    ContractError,
    FeedbackEvent,
    GenerationEvent,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings
from flywheel.stream.runner import KEYED_DECODE_REASONS, OutboxDeadLetters, decode_keyed
from flywheel.stream.store import StateStore, packed_headers, unpacked_headers
from flywheel.telemetry import Tracing, carried
from ingest.join import (
    Resolution,
    closes_at,
    closes_on_signal,
    generation_deadline,
    is_from_future,
    is_late,
    orphan_deadline,
    resolve,
    signal_of,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS gens (gid TEXT PRIMARY KEY, shard INTEGER NOT NULL,
    deadline REAL NOT NULL, raw BLOB NOT NULL, close_at REAL NOT NULL, off INTEGER, hdr BLOB);
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
#: Every reason this stage dead-letters a record for (dashboards/runbooks/dead-letters.md).
DEADLETTER_REASONS: tuple[str, ...] = (*KEYED_DECODE_REASONS, "clock_skew", "late_feedback", "orphan_feedback",
                                       "reused_feedback_id", "reused_generation_id")
_encode_json = msgspec.json.Encoder().encode


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
    """Implements :class:`flywheel.stream.runner.Stage` for generations + feedback -> episodes."""

    def __init__(self, cfg: IngestSettings, topics: Topics, store: StateStore,
                 registry: CollectorRegistry, tracing: Tracing | None = None) -> None:
        self.cfg, self.topics, self.store, self.db = cfg, topics, store, store.db
        self.tracing = tracing if tracing is not None else Tracing()
        self.dead = OutboxDeadLetters(store, topics.deadletter, "ingest", registry, DEADLETTER_REASONS)
        self.m = IngestMetrics(registry)
        self._last_prune = 0.0
        _migrate(store, cfg)
        self._check_stored_rows()

    def _check_stored_rows(self) -> None:
        """Once per store: decode every open generation and waiting feedback record as arrivals
        are decoded now, store each generation canonically, dead-letter what fails.

        Versions before the canonical store kept generations as they were sent, and an earlier
        ``decode`` took what today's refuses (UTF-16 text, a byte-order mark). Such a row would
        fail the window close that decodes it, or the archive write that parses its episode,
        after every restart alike; checked here, it fails alone, as a dead letter with its bytes.
        """
        db = self.db
        if db.execute("SELECT 1 FROM meta WHERE k='ingest_rows_checked'").fetchone() is not None:
            return
        with self.store.txn():
            for gid, shard, raw, off in _rows_of(db, "SELECT rowid, gid, shard, raw, off FROM gens"):
                try:
                    canonical = encode(decode(GenerationEvent, raw))
                except ContractError as exc:
                    self.dead.send(exc.reason, f"{exc.detail} (stored by an earlier version)",
                                   source_topic=self.topics.generations, value=raw, key=gid.encode(),
                                   partition=shard, offset=off)
                    db.execute("DELETE FROM gens WHERE gid=?", (gid,))
                    continue
                if canonical != raw:
                    db.execute("UPDATE gens SET raw=? WHERE gid=?", (canonical, gid))
            for fid, shard, raw, topic, part, off, key in _rows_of(
                    db, "SELECT rowid, fid, shard, raw, topic, part, off, key FROM fbs"):
                try:
                    decode(FeedbackEvent, raw, max_bytes=MAX_FEEDBACK_BYTES)
                except ContractError as exc:
                    self.dead.send(exc.reason, f"{exc.detail} (stored by an earlier version)",
                                   source_topic=topic, value=raw, key=key, partition=part, offset=off)
                    db.execute("DELETE FROM fbs WHERE fid=?", (fid,))
            db.execute("INSERT INTO meta VALUES ('ingest_rows_checked', '1') ON CONFLICT (k) DO NOTHING")

    # -- records --------------------------------------------------------------------------
    def process(self, records: list[ConsumerRecord], now: float) -> None:
        events: list[tuple[ConsumerRecord, Any]] = []
        gens = 0
        for rec in records:
            is_gen = rec.topic == self.topics.generations
            gens += is_gen
            event = (decode_keyed(GenerationEvent, rec, self.dead) if is_gen
                     else decode_keyed(FeedbackEvent, rec, self.dead, MAX_FEEDBACK_BYTES))
            if event is not None and not self._from_future(rec, event, now):
                events.append((rec, event))
        self.m.records.labels("generation").inc(gens)  # per batch: labels() is a lookup and a lock
        self.m.records.labels("feedback").inc(len(records) - gens)
        # One read of the rows this batch touches and one write per table at the end, instead
        # of several statements per record; the rules below run against this in-memory view.
        view = _BatchView(self.db, [ev for _, ev in events])
        for rec, event in events:
            if isinstance(event, GenerationEvent):
                self._on_generation(rec, event, view, now)
            else:
                self._on_feedback(rec, event, view, now)
        view.write(self.db)

    def _from_future(self, rec: ConsumerRecord, event: Any, now: float) -> bool:
        """Dead-letter a record stamped too far ahead of this stage's clock (see ingest/join.py)."""
        field = "completed_at" if isinstance(event, GenerationEvent) else "created_at"
        stamped = getattr(event, field)
        if not is_from_future(stamped, now, self.cfg.max_future_s):
            return False
        self.dead.send_record(rec, "clock_skew", f"{field} is {stamped - now:.0f}s ahead of the stage's clock "
                                                 f"(ingest.max_future_s is {self.cfg.max_future_s:g})")
        return True

    def _on_generation(self, rec: ConsumerRecord, g: GenerationEvent, view: _BatchView, now: float) -> None:
        gid = g.generation_id
        if gid in view.closed:  # (its bytes are gone: only its feedback ids are remembered)
            self.m.duplicates.labels("generation").inc()
            return
        # store the canonical encoding of the validated event: the episode splices these bytes
        # in when the window closes, without validating the generation a second time
        stored = encode(g)
        if gid in view.gens:
            # the stored bytes are compared as the events they hold: a store written by an
            # earlier version may hold another encoding of the very same generation
            if stored == (held := view.stored(self.db, gid)) or decode(GenerationEvent, held) == g:
                self.m.duplicates.labels("generation").inc()
            else:  # not a repeat: another completion under an id already taken, as for feedback
                self.dead.send_record(rec, "reused_generation_id",
                                      f"generation_id {gid!r} already names another generation, still open")
            return
        if len(stored) > MAX_RECORD_BYTES:
            # Numbers written out in full can grow a record a lot (-1e9 is -1000000000.0): over the
            # limit, its episode might not fit a produce request and would hold the outbox back.
            self.dead.send_record(rec, "oversized", f"{len(stored)} bytes once re-encoded (numbers written "
                                                    f"out in full) > limit {MAX_RECORD_BYTES}")
            return
        deadline = generation_deadline(g.completed_at, self.cfg.window_s)
        close_at = closes_at(deadline, now, self.cfg.window_s, self.cfg.grace_s)
        for fid, created, raw, topic, part, off, key in view.waiting(gid):
            if is_late(created, deadline):
                view.drop_feedback(gid, fid)
                self.dead.send("late_feedback", f"created {created - deadline:.3f}s after the window",
                               source_topic=topic, value=raw, key=key, partition=part, offset=off)
            elif self.cfg.emit_after_signal_s is not None:  # (a waiting signal's bytes were validated)
                close_at = closes_on_signal(close_at, signal_of(decode(FeedbackEvent, raw)), now,
                                            self.cfg.emit_after_signal_s)
        with self.tracing.record_span("ingest generation", carried(rec.headers), generation_id=gid) as headers:
            view.add_generation((gid, rec.partition, deadline, stored, close_at, rec.offset, packed_headers(headers)))

    def _on_feedback(self, rec: ConsumerRecord, f: FeedbackEvent, view: _BatchView, now: float) -> None:
        closed = view.closed.get(f.generation_id)
        if closed is not None:
            if f.feedback_id in closed:
                self.m.duplicates.labels("feedback").inc()
            else:
                self.dead.send_record(rec, "late_feedback", "generation's window already closed")
            return
        owner = view.fids.get(f.feedback_id)
        if owner == f.generation_id:
            self.m.duplicates.labels("feedback").inc()
            return
        if owner is not None:  # not a repeat: another signal under an id already taken
            self.dead.send_record(rec, "reused_feedback_id",
                                  f"feedback_id {f.feedback_id!r} already names feedback on generation {owner!r}")
            return
        deadline = view.gens.get(f.generation_id)
        if deadline is not None and is_late(f.created_at, deadline):
            self.dead.send_record(rec, "late_feedback", f"created {f.created_at - deadline:.3f}s after the window")
            return
        view.add_feedback(
            (f.feedback_id, f.generation_id, rec.partition, f.created_at,
             orphan_deadline(f.created_at, now, self.cfg.orphan_wait_s), rec.value,
             rec.topic, rec.partition, rec.offset, rec.key),
        )
        if deadline is not None and self.cfg.emit_after_signal_s is not None:
            view.close_by(f.generation_id, closes_on_signal(math.inf, signal_of(f), now, self.cfg.emit_after_signal_s))

    def clock_stepped(self, by: float) -> None:
        """The wall clock stepped ``by`` seconds while the stage ran (flywheel/stream/runner.py): move every
        time stored on it by as much. Windows, orphans' waits and the memory of closed windows
        then last as long as they would have: a forward step closed every open window at once,
        before feedback given in time could arrive (it became ``late_feedback``), and a step back
        held them open for the whole step. (A step while the stage is down looks like downtime:
        nothing tells them apart.)"""
        cond, mine = self.store.scoped()  # (this machine's clock: its shards of a shared store)
        self.db.execute(f"UPDATE gens SET close_at = close_at + ? WHERE 1=1{cond}", (by, *mine))
        self.db.execute(f"UPDATE fbs SET deadline = deadline + ? WHERE 1=1{cond}", (by, *mine))
        self.db.execute(f"UPDATE closed SET closed_at = closed_at + ? WHERE 1=1{cond}", (by, *mine))
        self._last_prune += by

    # -- windows --------------------------------------------------------------------------
    def tick(self, shards: set[int], now: float) -> bool:
        more = False
        for shard in sorted(self.store.mine(shards)):
            more |= self._close_due(shard, now)
            more |= self._orphans(shard, now)
        if now - self._last_prune > 10:
            self._last_prune = now
            cond, mine = self.store.scoped()
            self.db.execute(f"DELETE FROM closed WHERE closed_at<?{cond}", (now - self.cfg.closed_retention_s, *mine))
            for kind, table in (("generation", "gens"), ("feedback", "fbs")):
                self.m.window.labels(kind).set(
                    self.db.execute(f"SELECT count(*) FROM {table} WHERE 1=1{cond}", mine).fetchone()[0])
        return more

    def _close_due(self, shard: int, now: float) -> bool:
        """Close the due windows of ``shard``, the first ``max_batch`` of them by closing time, in a
        fixed number of statements (not four per window); returns whether more are due.

        Bounded because a backlog (a stage that was down, a slow catch-up) can leave hours of
        windows due at once: closing them in one transaction would build every episode in memory
        and one archive-queue entry larger than SQLite stores, failing alike after every restart.
        """
        due = self.db.execute(
            "SELECT close_at, rowid, deadline, gid, raw, off, hdr FROM gens WHERE shard=? AND close_at<? "
            "ORDER BY close_at, rowid LIMIT ?", (shard, now, self.cfg.max_batch)).fetchall()
        if not due:
            return False
        # The windows taken, as a range of the (shard, close_at, rowid) index: its last entry.
        taken = "shard=? AND close_at<? AND close_at<=? AND (close_at<? OR rowid<=?)"
        bound = (shard, now, due[-1][0], due[-1][0], due[-1][1])
        # (deadline, gid) order, sorted here: ORDER BY in SQL sorts the rows, blobs included, in
        # a temporary B-tree (several times the cost). gid is unique, so raw never compares.
        due = sorted(row[2:] for row in due)
        feedback: dict[str, list[FeedbackEvent]] = {}
        for gid, raw in self.db.execute(f"SELECT gid, raw FROM fbs WHERE gid IN (SELECT gid FROM gens WHERE {taken})",
                                        bound):
            # decode(), not a parser of its own: the same function accepted these bytes on arrival
            feedback.setdefault(gid, []).append(decode(FeedbackEvent, raw, max_bytes=MAX_FEEDBACK_BYTES))
        closed = []
        signals: dict[str, int] = {}
        for _, gid, raw, off, hdr in due:
            res = resolve(feedback.get(gid, []))
            closed.append((gid, shard, now, _encode_json(res.feedback_ids).decode()))
            episode = episode_bytes(raw, res, now)
            if len(episode) > MAX_EPISODE_BYTES:
                self._dead_letter_episode(gid, shard, raw, off, len(episode))
                continue
            with self.tracing.record_span("ingest episode", unpacked_headers(hdr) or [], generation_id=gid) as headers:
                self.store.append(shard, self.topics.episodes, gid, episode, archive=EPISODES_ARCHIVE, headers=headers)
            signals[res.signal] = signals.get(res.signal, 0) + 1
            if res.conflicted:
                self.m.conflicts.inc()
        for signal, count in signals.items():
            self.m.episodes.labels(signal).inc(count)
        self.db.executemany("INSERT INTO closed VALUES (?, ?, ?, ?)", closed)
        self.db.execute(f"DELETE FROM fbs WHERE gid IN (SELECT gid FROM gens WHERE {taken})", bound)
        self.db.execute(f"DELETE FROM gens WHERE {taken}", bound)
        return len(due) == self.cfg.max_batch

    def _dead_letter_episode(self, gid: str, shard: int, raw: bytes, off: int | None, size: int) -> None:
        """An episode too large to send: its generation and every feedback record it folded.

        A generation near its limit with thousands of feedback ids: reward would refuse the
        episode, and one too large for a produce request would hold the outbox back. Every
        input it was made of goes to the dead-letter topic, each naming where it came from, so
        that no user signal disappears without a record of it.
        """
        # read again here, not kept from the close's read: only this rare path needs them
        folded = self.db.execute("SELECT raw, topic, part, off, key FROM fbs WHERE gid=?", (gid,)).fetchall()
        why = f"episode of {size} bytes ({len(folded)} feedback records) > limit {MAX_EPISODE_BYTES}"
        # the generation's stored bytes are its canonical encoding (the same event); the
        # offset finds the record as it was sent
        self.dead.send("oversized", f"{why}; the value is its generation, re-encoded",
                       source_topic=self.topics.generations, value=raw, key=gid.encode(), partition=shard, offset=off)
        for value, topic, part, offset, key in folded:
            self.dead.send("oversized", f"{why}; this feedback was folded into it",
                           source_topic=topic, value=value, key=key, partition=part, offset=offset)

    def _orphans(self, shard: int, now: float) -> bool:
        """Dead-letter feedback whose generation never came, ``max_batch`` at most; returns
        whether more are due."""
        rows = self.db.execute(
            "SELECT fid, gid, created, deadline, raw, topic, part, off, key FROM fbs f WHERE shard=? AND deadline<? "
            "AND NOT EXISTS (SELECT 1 FROM gens g WHERE g.gid=f.gid) LIMIT ?",
            (shard, now - self.cfg.grace_s, self.cfg.max_batch)).fetchall()
        retention = self.cfg.closed_retention_s
        for fid, gid, created, deadline, raw, topic, part, off, key in rows:
            self.db.execute("DELETE FROM fbs WHERE fid=?", (fid,))
            # Delivered longer after it was made than closed windows are remembered, the feedback
            # may be for a generation whose window closed and was forgotten before it came: no
            # orphan but very late, and the letter should say so. (Its arrival is its orphan
            # deadline less the wait, when it came after it was made.)
            delay = deadline - self.cfg.orphan_wait_s - created
            detail = f"generation {gid} never arrived"
            if delay > retention:
                detail = (f"generation {gid} not seen; the feedback came {delay:.0f}s after it was made, so its "
                          f"generation's window may have closed longer ago than ingest.closed_retention_s "
                          f"({retention:.0f}s) and been forgotten: too late to count either way")
            self.dead.send("orphan_feedback", detail,
                           source_topic=topic, value=raw, key=key, partition=part, offset=off)
        return len(rows) == self.cfg.max_batch


def episode_bytes(generation: bytes, res: Resolution, resolved_at: float) -> bytes:
    """``encode(EpisodeEvent(...))`` with the stored generation's bytes spliced in.

    The generation was validated when it arrived and stored as its canonical encoding, so
    rebuilding and re-serialising the nested model per episode would only repeat that work. The
    field order is EpisodeEvent's; tests/unit/test_ingest_join.py holds the bytes equal to the
    model-built record's ``encode``.
    """
    rest = _encode_json({
        "signal": res.signal, "edited_text": res.edited_text, "decision_ms": res.decision_ms,
        "feedback_ids": res.feedback_ids, "timed_out": res.timed_out,
        "conflicted": res.conflicted, "rater_id": res.rater_id, "resolved_at": resolved_at,
    })
    return b'{"schema_version":1,"kind":"episode","generation":' + generation + b"," + rest[1:]


class _BatchView:
    """The join state one batch touches, read in a few queries and written back in a few.

    ``gens``/``closed`` map the batch's generation ids to their deadline / folded feedback ids;
    ``fids`` maps the waiting feedback ids the batch mentions to their generation; ``_waiting`` the waiting feedback
    rows of the batch's generations. Rules see the batch's own inserts and drops, in order.
    """

    def __init__(self, db: Any, events: list[Any]) -> None:
        gids = sorted({e.generation_id for e in events})
        gen_ids = sorted({e.generation_id for e in events if isinstance(e, GenerationEvent)})
        fids = sorted({e.feedback_id for e in events if isinstance(e, FeedbackEvent)})
        self.gens: dict[str, float] = dict(_select_in(db, "SELECT gid, deadline FROM gens WHERE gid IN ({})", gids))
        self.closed: dict[str, list[str]] = {
            gid: json.loads(f) for gid, f in _select_in(db, "SELECT gid, fids FROM closed WHERE gid IN ({})", gids)}
        self.fids: dict[str, str] = dict(_select_in(db, "SELECT fid, gid FROM fbs WHERE fid IN ({})", fids))
        self._waiting: dict[str, dict[str, tuple]] = {}
        for gid, *row in _select_in(
                db, "SELECT gid, fid, created, raw, topic, part, off, key FROM fbs WHERE gid IN ({})", gen_ids):
            self._waiting.setdefault(gid, {})[row[0]] = tuple(row)
        self._new_gens: list[tuple] = []
        self._new_raw: dict[str, bytes] = {}
        self._new_fbs: dict[str, tuple] = {}
        self._dropped: list[str] = []
        self._close_by: dict[str, float] = {}

    def stored(self, db: Any, gid: str) -> bytes:
        """The stored bytes of open generation ``gid``: looked up only for a repeated id."""
        if (raw := self._new_raw.get(gid)) is not None:
            return raw
        return db.execute("SELECT raw FROM gens WHERE gid=?", (gid,)).fetchone()[0]

    def waiting(self, gid: str) -> list[tuple]:
        return list(self._waiting.get(gid, {}).values())

    def add_generation(self, row: tuple) -> None:
        self.gens[row[0]] = row[2]
        self._new_gens.append(row)
        self._new_raw[row[0]] = row[3]

    def add_feedback(self, row: tuple) -> None:
        fid, gid, created, raw, topic, part, off, key = row[0], row[1], row[3], row[5], row[6], row[7], row[8], row[9]
        self.fids[fid] = gid
        self._new_fbs[fid] = row
        self._waiting.setdefault(gid, {})[fid] = (fid, created, raw, topic, part, off, key)

    def close_by(self, gid: str, at: float) -> None:
        """Close open generation ``gid``'s window no later than ``at`` (early emission)."""
        if at < self._close_by.get(gid, math.inf):
            self._close_by[gid] = at

    def drop_feedback(self, gid: str, fid: str) -> None:
        self.fids.pop(fid, None)
        self._waiting.get(gid, {}).pop(fid, None)
        if self._new_fbs.pop(fid, None) is None:
            self._dropped.append(fid)

    def write(self, db: Any) -> None:
        db.executemany("DELETE FROM fbs WHERE fid=?", [(f,) for f in self._dropped])
        db.executemany("INSERT INTO gens (gid, shard, deadline, raw, close_at, off, hdr) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       self._new_gens)
        db.executemany("INSERT INTO fbs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", list(self._new_fbs.values()))
        # after the inserts, so it applies to a generation of this same batch too
        db.executemany("UPDATE gens SET close_at = MIN(close_at, ?) WHERE gid=?",
                       [(at, gid) for gid, at in self._close_by.items()])


def _migrate(store: StateStore, cfg: IngestSettings) -> None:
    """Bring a store written by an earlier version up to this one's tables.

    Stores from before ``gens.close_at`` close their open windows by the old rule (``grace_s``
    after the deadline): when those generations arrived is not recorded. The index is created
    here rather than in SCHEMA because on such a store the column exists only after this runs.
    Generations stored before ``gens.off`` have no source offset (a dead letter of one names none),
    and those stored before ``gens.hdr`` no request id (their episodes carry none).
    """
    db = store.db
    if {"close_at", "off", "hdr"} - store.columns("gens"):
        # replicas starting together each find them missing: one at a time, reading them again
        with store.schema_change():
            columns = store.columns("gens")
            if "close_at" not in columns:
                store.add_column("gens", "close_at", "REAL NOT NULL DEFAULT 0")
                db.execute("UPDATE gens SET close_at = deadline + ?", (cfg.grace_s,))
                db.execute("DROP INDEX IF EXISTS gens_due")
            if "off" not in columns:
                store.add_column("gens", "off", "INTEGER")
            if "hdr" not in columns:
                store.add_column("gens", "hdr", "BLOB")
    db.executescript("CREATE INDEX IF NOT EXISTS gens_close ON gens (shard, close_at)")


def _rows_of(db: Any, select: str, chunk: int = 1000) -> Iterator[tuple]:
    """The rows of ``select`` (its first column the rowid, left out), read ``chunk`` at a time
    in rowid order, so that a table of any size is walked in bounded memory and its rows may be
    changed meanwhile."""
    after = -(2**63)
    while rows := db.execute(f"{select} WHERE rowid>? ORDER BY rowid LIMIT ?", (after, chunk)).fetchall():
        after = rows[-1][0]
        for row in rows:
            yield row[1:]


def _select_in(db: Any, sql: str, keys: list[str], chunk: int = 500) -> list[tuple]:
    """``sql`` with ``IN ({})`` over ``keys``, in chunks that stay under SQLite's parameter limit."""
    out: list[tuple] = []
    for i in range(0, len(keys), chunk):
        part = keys[i:i + chunk]
        out.extend(db.execute(sql.format(",".join("?" * len(part))), part).fetchall())
    return out
