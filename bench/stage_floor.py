"""The least any exactly-once stage must do per record, measured: a ceiling on the stages' ratio.

``python bench/ingest_throughput.py`` measures these rows in the same run as the stages, on the
same episodes, and prints them in its table ("floor: ...").

Whatever its logic, a stage that takes one record in and sends one record on, exactly once,
must at least:

1. consume the record (the raw rate: the baseline of the ratio);
2. send one record on and collect its ack, with an id in a header for recovery to find;
3. hold the batch's outputs durably until they are acked, with the input offsets past them;
4. validate the record against its contract at the edge (``flywheel.contracts.decode``, the
   one validator of the wire types); a row before it only parses the JSON, which no validation
   can cost less than.

:func:`floor_rate` runs exactly that and no more, as lean as this stack allows: the output is the
input record's bytes unchanged (no encode), its partition the input's (no partitioner), no
metrics, no archive, no join or guard state, no dead letters; confluent-kafka with one callback
for every ack. Step 3 is measured two ways: the cheapest durable write there is (the batch
appended to a file and fsynced; no index, no checksum, no compaction), and one SQLite
transaction per batch (WAL, ``synchronous=FULL``, as the stages keep their state) holding the
batch as one blob, deleted once every record of it is acked. Each row of :func:`floor_rows` adds
one step to the one before (or, as its label says, does one another way). The records are
episodes, the reward stage's input, one output each. No stage can beat a row whose steps it
must take, so the rows bound what any implementation of the reward stage on these clients can
reach, not only the one in ``reward/``; ingest, which sends one record per two it reads, has a
floor of its own that these rows do not measure.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
from kafka import TopicPartition

from flywheel.bus import ensure_topics, make_consumer, partitions_of
from flywheel.contracts import MAX_EPISODE_BYTES, EpisodeEvent, decode
from flywheel.settings import KafkaSettings
from ingest.exactly_once import OUTBOX_HEADER

_pack = msgspec.msgpack.Encoder().encode
_parse = msgspec.json.Decoder().decode


def _validate(value: bytes) -> None:
    decode(EpisodeEvent, value, max_bytes=MAX_EPISODE_BYTES)


#: What a floor row does with each record it reads, besides relaying it.
CHECKS = {"parse": _parse, "validate": _validate}


def floor_rate(cfg: KafkaSettings, topic_in: str, topic_out: str, expect: int, work: Path, *,
               store: str | None, check: str | None, max_batch: int = 5000) -> tuple[float, float]:
    """Records/s (wall, and per CPU-second of this process) of the least exactly-once relay.

    The clock starts once the first batch is consumed and sent, as for the stages in
    bench/ingest_throughput.py (``stage_rate``), and stops when every record is acked and its
    batch deleted from the store.
    """
    from confluent_kafka import Producer

    # assigned, not subscribed: no group join to wait for (the clock starts after the first batch anyway)
    consumer = make_consumer(cfg, "bench-floor", None)
    consumer.assign([TopicPartition(topic_in, p) for p in partitions_of(consumer, topic_in)])
    producer = Producer({"bootstrap.servers": cfg.bootstrap, "enable.idempotence": True, "acks": "all",
                         "linger.ms": cfg.linger_ms})
    producer.list_topics(topic_out, timeout=10.0)  # metadata and connection before the clock starts
    held = {"sqlite": SqliteHold, "file": FileHold}[store](work) if store else None
    acked: list[int] = []

    def on_ack(err: object, msg: object) -> None:
        if err is not None:
            raise RuntimeError(f"send failed in the floor benchmark: {err}")
        acked.append(1)

    owed: list[tuple[int, int]] = []  # (batch id, records) sent and not yet wholly acked
    seen = batch_id = 0
    start: tuple[float, float, int] | None = None
    was_enabled = gc.isenabled()
    gc.disable()  # as the stages do while a batch is in hand (ingest/runner.py, gc_paused)
    try:
        while seen < expect or owed:
            records = [r for recs in consumer.poll(timeout_ms=100, max_records=max_batch).values() for r in recs]
            if records:
                batch_id += 1
                if check is not None:
                    for rec in records:
                        CHECKS[check](rec.value)
                if held is not None:
                    held.hold(batch_id, records)
                header = b"floor:%d:" % batch_id
                for i, rec in enumerate(records):
                    producer.produce(topic_out, rec.value, rec.key, partition=rec.partition,
                                     headers=[(OUTBOX_HEADER, header + b"%d" % i)], on_delivery=on_ack)
                owed.append((batch_id, len(records)))
                seen += len(records)
            producer.poll(0 if records else 0.01)
            done = _settle(owed, acked)
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

    def hold(self, batch_id: int, records: list) -> None:
        offsets = {(r.topic, r.partition): r.offset + 1 for r in records}
        with self.db:
            self.db.execute("INSERT INTO outbox VALUES (?, ?)", (batch_id, _outputs(records)))
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

    def hold(self, batch_id: int, records: list) -> None:
        offsets = {f"{r.topic}[{r.partition}]": r.offset + 1 for r in records}
        os.write(self.fd, _pack((batch_id, offsets, _outputs(records))))
        os.fsync(self.fd)

    def release(self, batches: list[int]) -> None:
        return None  # a log would note it in its next append; nothing to write here

    def close(self) -> None:
        os.close(self.fd)


def _outputs(records: list) -> bytes:
    return _pack([(r.partition, r.key, r.value) for r in records])


def _settle(owed: list[tuple[int, int]], acked: list[int]) -> list[int]:
    """The batches whose every record is acked, oldest first (acks come in send order)."""
    done: list[int] = []
    while owed and len(acked) >= owed[0][1]:
        batch, n = owed.pop(0)
        del acked[:n]
        done.append(batch)
    return done


#: (label, store, check) of each row: each adds one step to the one before, or replaces it.
FLOOR_STEPS: tuple[tuple[str, str | None, str | None], ...] = (
    ("floor: consume + acked send", None, None),
    ("floor: + outputs durable (file, fsync)", "file", None),
    ("floor: + parse each record (no validation)", "file", "parse"),
    ("floor: + validate instead (the contract's decode)", "file", "validate"),
    ("floor: same, durable in SQLite instead", "sqlite", "validate"),
)


Rate = tuple[float, float]  # records/s by the wall clock, and per CPU-second of this process


def floor_rows(cfg: KafkaSettings, topic_in: str, prefix: str, expect: int, work: Path, repeat: int,
               raw: Callable[[], Rate]) -> list[tuple[str, Rate, Rate]]:
    """``(label, rates, ratios to the raw rate)`` of a raw consume and of each floor step on
    ``topic_in``, ``repeat`` rounds, to topics named from ``prefix``.

    Each round measures the raw consume (``raw()``) and then every step, and a step's ratio is
    the median over rounds of its rate over that round's raw rate: on a machine whose speed
    drifts from one second to the next (shared cores), a ratio of two runs seconds apart is
    steadier than a ratio of two medians taken a minute apart.
    """
    ensure_topics(cfg, [f"{prefix}floor{i}-{r}" for i in range(len(FLOOR_STEPS)) for r in range(repeat)])
    raws: list[Rate] = []
    runs: list[list[Rate]] = [[] for _ in FLOOR_STEPS]
    for r in range(repeat):
        raws.append(raw())
        for i, (_, store, check) in enumerate(FLOOR_STEPS):
            runs[i].append(floor_rate(cfg, topic_in, f"{prefix}floor{i}-{r}", expect, work, store=store, check=check))

    def row(label: str, rates: list[Rate]) -> tuple[str, Rate, Rate]:
        ratios = [(a[0] / b[0], a[1] / b[1]) for a, b in zip(rates, raws, strict=True)]
        return label, _median(rates), _median(ratios)

    return [row("raw consume (episodes)", raws), *(row(label, rates) for (label, _, _), rates in zip(FLOOR_STEPS, runs))]


def _median(pairs: list[Rate]) -> Rate:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
