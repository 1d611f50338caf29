"""How many Parquet files the episode archive gets at a steady trickle, and what reading it costs.

Run: ``python bench/archive_files.py [--rate 50] [--seconds 20]``. One process starts the embedded
broker and, for each archive setting, feeds the ingest stage (flywheel's own loop, state store and
outbox) ``rate`` generations/s plus one feedback each for ``seconds``, on topics of its own; then
it stops the stage cleanly and reads the archive back with ``pd.read_parquet``.

- ``per loop turn`` (``archive.max_age_s = 0``): every loop turn that delivered episodes writes
  its own file, which is what the stages did before the archive queue: the baseline;
- ``batched`` (the defaults, ``max_rows`` 50,000 / ``max_age_s`` 300): the queue is written when
  it is due, and at the clean stop.

It prints one table: episodes, files, rows per file, files per hour at this rate (per loop turn:
the run's count scaled to an hour; batched: one write per ``max_age_s`` or per ``max_rows``
rows, whichever comes first, plus one for the hour's edge, since a short run writes once, at its
stop), the time to read the run's archive, and this process's CPU seconds over the run (the stage
and the feeder, which is the same in both runs).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pandas as pd

from flywheel.contracts import FeedbackEvent, GenerationEvent, SamplingParams, Topics, encode
from flywheel.kafka.clients import make_consumer, make_producer
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.producers import make_output_producer
from flywheel.kafka.topics import ensure_declared
from flywheel.metrics import new_registry
from flywheel.settings import ArchiveSettings, IngestSettings, KafkaSettings
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.outbox import Outbox
from flywheel.stream.runner import StreamRunner
from flywheel.stream.store import StateStore
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from ingest.stage import EPISODES_ARCHIVE, SCHEMA, IngestStage
from local.broker import EmbeddedBroker


def trickle(cfg: KafkaSettings, topics: Topics, rate: float, seconds: float, done: list[int]) -> None:
    """``rate`` generations/s, each with an accept, stamped now; ``done`` gets the count at the end."""
    producer = make_producer(cfg, "bench-trickle", linger_ms=5)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64)
    start, i = time.time(), 0
    while time.time() - start < seconds:
        t, gid = time.time(), f"g{i}"
        g = GenerationEvent(
            generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id=f"u{i % 50}",
            endpoint="chat", created_at=t, completed_at=t, latency_ms=20, prompt_text="a prompt",
            prompt_token_ids=(1, 2, 3), completion_text="x" * 96, completion_token_ids=tuple(range(32)),
            logprobs=(-0.5,) * 32, sampling=sp, finish_reason="stop")
        f = FeedbackEvent(feedback_id=f"f{i}", generation_id=gid, signal="accept", created_at=t, received_at=t)
        producer.send(topics.generations, key=gid, value=encode(g))
        producer.send(topics.feedback, key=gid, value=encode(f))
        i += 1
        time.sleep(max(0.0, start + i / rate - time.time()))
    producer.flush()
    producer.close()
    done.append(i)


def run(base: KafkaSettings, archive: ArchiveSettings, rate: float, seconds: float, work: Path) -> dict:
    topics = Topics(f"b{uuid.uuid4().hex[:6]}.")
    ensure_declared(base, topics)
    arch = ParquetArchive(work / "episodes", EPISODE_SCHEMA, episode_row, episode_table)
    store = StateStore(work / "state.sqlite3", SCHEMA)
    registry = new_registry()
    stage = IngestStage(IngestSettings(window_s=1, grace_s=0), topics, store, registry)
    outbox = Outbox(store, make_output_producer(base, "bench-archive"), {EPISODES_ARCHIVE: arch},
                    archive_max_rows=archive.max_rows, archive_max_age_s=archive.max_age_s)
    consumer = make_consumer(base, "bench-archive", f"archive-{uuid.uuid4().hex[:6]}")
    runner = StreamRunner(stage, store, outbox, consumer, [topics.generations, topics.feedback],
                          LagGauge("bench", registry), 5000, 200)
    done: list[int] = []
    feeder = threading.Thread(target=trickle, args=(base, topics, rate, seconds, done))
    cpu = time.process_time()
    feeder.start()
    while not done or runner.delivered < done[0]:
        runner.step()
    runner.finish()
    cpu = time.process_time() - cpu  # this process: the stage and the feeder (the same in both runs)
    feeder.join()
    consumer.close()
    outbox.producer.close()
    store.close()
    files = arch.files()
    start = time.perf_counter()
    rows = len(pd.read_parquet(work / "episodes"))
    read_s = time.perf_counter() - start
    if archive.max_age_s > 0:  # a short run ends with one write at the clean stop: count the hour's writes
        per_hour = max(3600 / archive.max_age_s, done[0] / seconds * 3600 / archive.max_rows) + 1  # +1: the hour's edge
    else:
        per_hour = len(files) * 3600 / seconds
    return {"episodes": done[0], "rows": rows, "files": len(files), "read_ms": read_s * 1000,
            "files_per_hour": per_hour, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=50.0, help="generations per second (each with one feedback)")
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    settings = {"per loop turn (max_age_s=0)": ArchiveSettings(max_age_s=0),
                "batched (defaults)": ArchiveSettings()}
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        cfg = KafkaSettings(bootstrap=broker.bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500,
                            partitions=2, producer_client="confluent")
        results = {name: run(cfg, archive, args.rate, args.seconds, Path(tmp) / str(i))
                   for i, (name, archive) in enumerate(settings.items())}
    print(f"\ningest at {args.rate:g} generations/s + feedback for {args.seconds:g} s, embedded broker\n")
    print(f"{'archive':<30}{'episodes':>9}{'files':>7}{'rows/file':>10}{'files/hour':>12}"
          f"{'read ms':>9}{'cpu s':>7}")
    base = results["per loop turn (max_age_s=0)"]
    for name, r in results.items():
        assert r["rows"] == r["episodes"], f"{name}: archive holds {r['rows']} rows for {r['episodes']} episodes"
        print(f"{name:<30}{r['episodes']:>9}{r['files']:>7}{r['episodes'] / r['files']:>10.1f}"
              f"{r['files_per_hour']:>12,.0f}{r['read_ms']:>9.0f}{r['cpu_s']:>7.2f}")
    batched = results["batched (defaults)"]
    print(f"\nbatched / per loop turn: files an hour {batched['files_per_hour'] / base['files_per_hour']:.4f}, "
          f"read time {batched['read_ms'] / base['read_ms']:.2f}, cpu {batched['cpu_s'] / base['cpu_s']:.2f}")


if __name__ == "__main__":
    main()
