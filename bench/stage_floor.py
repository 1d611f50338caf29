"""The least any exactly-once stage must do per record, measured: a ceiling on the stages' ratio.

``python bench/ingest_throughput.py`` measures these rows in the same run as the stages, on the
same records, and prints them in a table of their own ("floor: ...").

Whatever its logic, a stage that takes records in and sends records on, exactly once, must at
least:

1. consume every record (the raw rate: the baseline of the ratio);
2. send each output on and collect its ack, with an id in a header for recovery to find;
3. hold the batch's outputs durably until they are acked, with the input offsets past them;
4. validate every record against its contract at the edge (``flywheel.contracts.decode``, the
   one validator of the wire types); a row before it only parses the JSON, which no validation
   can cost less than.

:func:`floor_rate` runs exactly that and no more, as lean as this stack allows: no partitioner
(an output goes to its input's partition number), no metrics, no archive, no guard or dedupe
state, no dead letters; confluent-kafka with one callback for every ack. Step 3 is measured two
ways: the cheapest durable write there is (the batch appended to a file and fsynced; no index,
no checksum, no compaction), and one SQLite transaction per batch (WAL, ``synchronous=FULL``, as
the stages keep their state) holding the batch as one blob, deleted once every record of it is
acked. Two shapes:

- reward's (:data:`REWARD_STEPS`): episodes in, one output each, the input's bytes unchanged
  (no encode); each row adds one step to the one before, or, as its label says, does one
  another way;
- ingest's (:data:`INGEST_STEPS`): generations and feedback in, validated, and one episode out
  per generation, its bytes spliced around the generation's as they came (no re-encode), with
  the signal of a feedback record of the same batch when there is one. Its durable hold stands
  for the join state as well: a generation waits in it until its window closes, here at once.

No stage can beat a row whose steps it must take, so the rows bound what any implementation of
the stage on these clients can reach, not only the one in ``ingest/`` and ``reward/``.
"""

from __future__ import annotations

import gc
import math
import os
import sqlite3
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
from kafka import TopicPartition

from flywheel.contracts import (
    MAX_EPISODE_BYTES,
    MAX_FEEDBACK_BYTES,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    decode,
)
from flywheel.kafka.clients import ensure_topics, make_consumer, partitions_of
from flywheel.settings import KafkaSettings

_pack = msgspec.msgpack.Encoder().encode
_parse = msgspec.json.Decoder().decode

#: One output: (partition, key, value).
Output = tuple[int, bytes | None, bytes]
#: What a floor does with a batch of records: the outputs it sends for them.
Work = Callable[[list], list[Output]]


def relay(check: Callable[[bytes], object] | None) -> Work:
    """Reward's shape: each record (``check``ed) sent on as it is."""
    def work(records: list) -> list[Output]:
        if check is not None:
            for rec in records:
                check(rec.value)
        return [(r.partition, r.key, r.value) for r in records]
    return work


def validate_episode(value: bytes) -> None:
    decode(EpisodeEvent, value, max_bytes=MAX_EPISODE_BYTES)


def join(generations: str) -> Work:
    """Ingest's shape: every record validated, one episode per generation (``generations`` is
    that topic's name), its signal from a feedback record of the same batch where there is one."""
    def work(records: list) -> list[Output]:
        gens, signals = [], {}
        for rec in records:
            if rec.topic == generations:
                decode(GenerationEvent, rec.value)
                gens.append(rec)
            else:
                signals[rec.key] = decode(FeedbackEvent, rec.value, max_bytes=MAX_FEEDBACK_BYTES).signal
        return [(g.partition, g.key, b'{"schema_version":1,"kind":"episode","generation":' + g.value
                 + b',"signal":"%s","resolved_at":%d}' % (signals.get(g.key, "ignore").encode(), g.timestamp // 1000))
                for g in gens]
    return work


def floor_rate(cfg: KafkaSettings, topics_in: list[str], topic_out: str, expect: int, work: Path, *,
               store: str | None, batch: Work, max_batch: int = 5000) -> tuple[float, float]:
    """Input records/s (wall, and per CPU-second of this process) of the least exactly-once stage
    that makes ``batch``'s outputs of its input.

    The clock starts once the first batch is consumed and sent, as for the stages in
    bench/ingest_throughput.py (``stage_rate``), and stops when every output is acked and its
    batch released from the store.
    """
    from confluent_kafka import Producer

    # assigned, not subscribed: no group join to wait for (the clock starts after the first batch anyway)
    consumer = make_consumer(cfg, "bench-floor", None)
    consumer.assign([TopicPartition(t, p) for t in topics_in for p in partitions_of(consumer, t)])
    producer = Producer({"bootstrap.servers": cfg.bootstrap, "enable.idempotence": True, "acks": "all",
                         "linger.ms": cfg.linger_ms})
    producer.list_topics(topic_out, timeout=10.0)  # metadata and connection before the clock starts
    held = {"sqlite": SqliteHold, "file": FileHold}[store](work) if store else None
    owed: dict[int, int] = {}  # batch id -> its outputs not acked yet

    def acks_of(batch_id: int) -> Callable[[object, object], None]:
        # per batch: acks come in send order within a partition only, and outputs span partitions
        def on_ack(err: object, msg: object) -> None:
            if err is not None:
                raise RuntimeError(f"send failed in the floor benchmark: {err}")
            owed[batch_id] -= 1
        return on_ack

    seen = batch_id = 0
    start: tuple[float, float, int] | None = None
    was_enabled = gc.isenabled()
    gc.disable()  # as the stages do while a batch is in hand (flywheel/stream/runner.py, gc_paused)
    try:
        while seen < expect or owed:
            records = [r for recs in consumer.poll(timeout_ms=100, max_records=max_batch).values() for r in recs]
            if records:
                batch_id += 1
                outputs = batch(records)
                if held is not None:
                    held.hold(batch_id, records, outputs)
                on_ack = acks_of(batch_id)
                owed[batch_id] = len(outputs)
                for _part, key, value in outputs:
                    # partitioned by key, as the stages' outbox sends (flywheel/stream/outbox.py)
                    producer.produce(topic_out, value, key, on_delivery=on_ack)
                seen += len(records)
            producer.poll(0 if records else 0.01)
            done = _settle(owed)
            if done and held is not None:
                held.release(done)
            if start is None and records:
                start = (time.perf_counter(), time.process_time(), seen)
    finally:
        if was_enabled:
            gc.enable()
        consumer.close()
        producer.flush(10)
        producer.close()
        if held is not None:
            held.close()
    assert start is not None
    elapsed, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    return (expect - start[2]) / elapsed, (expect - start[2]) / cpu


class SqliteHold:
    """Each batch's outputs as one blob in SQLite, with the input offsets, in one transaction."""

    def __init__(self, work: Path) -> None:
        self.db = sqlite3.connect(str(work / f"floor-{uuid.uuid4().hex[:6]}.sqlite3"), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript("""
            CREATE TABLE outbox (batch INTEGER PRIMARY KEY, data BLOB NOT NULL);
            CREATE TABLE offsets (topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL,
                                  PRIMARY KEY (topic, part));""")
        self.db.isolation_level = "IMMEDIATE"  # `with self.db:` then opens and commits a transaction

    def hold(self, batch_id: int, records: list, outputs: list[Output]) -> None:
        offsets = {(r.topic, r.partition): r.offset + 1 for r in records}
        with self.db:
            self.db.execute("INSERT INTO outbox VALUES (?, ?)", (batch_id, _pack(outputs)))
            self.db.executemany(
                "INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, part) DO UPDATE SET next=excluded.next",
                [(t, p, n) for (t, p), n in offsets.items()])

    def release(self, batches: list[int]) -> None:
        with self.db:
            self.db.executemany("DELETE FROM outbox WHERE batch=?", [(b,) for b in batches])

    def close(self) -> None:
        self.db.close()


class FileHold:
    """Each batch's outputs and input offsets appended to a file and fsynced: the least a durable
    write can cost (a real log also needs checksums, an index and compaction)."""

    def __init__(self, work: Path) -> None:
        self.fd = os.open(work / f"floor-{uuid.uuid4().hex[:6]}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def hold(self, batch_id: int, records: list, outputs: list[Output]) -> None:
        offsets = {f"{r.topic}[{r.partition}]": r.offset + 1 for r in records}
        os.write(self.fd, _pack((batch_id, offsets, outputs)))
        os.fsync(self.fd)

    def release(self, batches: list[int]) -> None:
        return None  # a log would note it in its next append; nothing to write here

    def close(self) -> None:
        os.close(self.fd)


def _settle(owed: dict[int, int]) -> list[int]:
    """The batches whose every output is acked, taken out of ``owed``."""
    done = [batch for batch, left in owed.items() if left == 0]
    for batch in done:
        del owed[batch]
    return done


#: (label, store, work) of each row of reward's shape, on episodes.
REWARD_STEPS: tuple[tuple[str, str | None, Work], ...] = (
    ("floor: consume + acked send", None, relay(None)),
    ("floor: + outputs durable (file, fsync)", "file", relay(None)),
    ("floor: + parse each record (no validation)", "file", relay(_parse)),
    ("floor: + validate instead (the contract's decode)", "file", relay(validate_episode)),
    ("floor: same, durable in SQLite instead", "sqlite", relay(validate_episode)),
)


def ingest_steps(generations: str) -> tuple[tuple[str, str | None, Work], ...]:
    """(label, store, work) of each row of ingest's shape, on generations and feedback."""
    return (
        ("floor, ingest's shape: validate, join, send, file", "file", join(generations)),
        ("floor, ingest's shape: same, SQLite instead", "sqlite", join(generations)),
    )


Rate = tuple[float, float]  # records/s by the wall clock, and per CPU-second of this process


def floor_rows(cfg: KafkaSettings, inputs: list[str], raw_label: str, steps: tuple[tuple[str, str | None, Work], ...],
               prefix: str, expect: int, work: Path, repeat: int,
               raw: Callable[[], Rate]) -> list[tuple[str, Rate, Rate]]:
    """``(label, rates, ratios to the raw rate)`` of a raw consume of ``inputs`` and of each of
    ``steps`` on them, ``repeat`` rounds, to topics named from ``prefix``.

    Each round measures the raw consume (``raw()``) and then every step, and a step's ratio is
    the median over rounds of its rate over that round's raw rate: on a machine whose speed
    drifts from one second to the next (shared cores), a ratio of two runs seconds apart is
    steadier than a ratio of two medians taken a minute apart.
    """
    tag = uuid.uuid4().hex[:4]
    outs = [[f"{prefix}floor-{tag}-{i}-{r}" for r in range(repeat)] for i in range(len(steps))]
    ensure_topics(cfg, [t for ts in outs for t in ts])
    raws: list[Rate] = []
    runs: list[list[Rate]] = [[] for _ in steps]
    for r in range(repeat):
        raws.append(raw())
        for i, (_, store, batch) in enumerate(steps):
            runs[i].append(floor_rate(cfg, inputs, outs[i][r], expect, work, store=store, batch=batch))

    def row(label: str, rates: list[Rate]) -> tuple[str, Rate, Rate]:
        # (a run too short for the CPU clock to tick, as --pairs 500 can be, has no ratio)
        ratios = [(a[0] / b[0] if b[0] else math.nan, a[1] / b[1] if b[1] else math.nan)
                  for a, b in zip(rates, raws, strict=True)]
        return label, _median(rates), _median(ratios)

    return [row(raw_label, raws), *(row(label, rates) for (label, _, _), rates in zip(steps, runs))]


def _median(pairs: list[Rate]) -> Rate:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
