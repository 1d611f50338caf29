"""Throughput of the ingest (join) and reward (label) stages against raw consumption.

Run: ``python bench/ingest_throughput.py [--pairs 20000] [--clients confluent,kafka-python]``. One
process starts the embedded broker and, for each output producer client (``KafkaSettings.
producer_client``) on topics of its own, produces ``pairs`` generations and one feedback each, then
measures, on the same messages with the same consumer settings (flywheel.kafka.clients.make_consumer):

- raw: a consumer group reading every input record and doing nothing else;
- ingest: the full stage (decode, dedupe, join in the SQLite state store, window close, outbox,
  delivery with acks, Parquet archive) until every episode is delivered and archived;
- reward: the same for episodes -> rewards;
- relay: episodes consumed and sent on unchanged with the stages' output producer, no decode and
  no state: the ceiling for any stage that emits a record per input record in one process;
- exactly-once relay: the same records through the stages' own loop (flywheel's StreamRunner,
  state store, outbox, acks) with no decode and no stage logic: what exactly-once output costs;
- + validate: that, plus each record decoded and validated at the edge as the stages do: the
  floor under any stage that must validate its input and emit exactly once.

The last three rows split the reward stage's gap to the raw rate into its parts. A second table
(with the confluent client) has the rows of bench/stage_floor.py on the same records: the least any
exactly-once stage of each shape must do (acked sends, outputs held durably until acked, the input
validated), each as lean as these clients allow, a ceiling on what any implementation of the
stages can reach; each of its rounds pairs a raw consume with every row after it.

"""


from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from stage_floor import REWARD_STEPS, Rate, floor_rows, ingest_steps

from flywheel.contracts import (
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    Topics,
    encode,
)
from flywheel.kafka.clients import ensure_topics, make_consumer, make_producer
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.producers import make_output_producer
from flywheel.metrics import new_registry
from flywheel.settings import IngestSettings, KafkaSettings, RewardSettings
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.outbox import Outbox
from flywheel.stream.runner import (
    KEYED_DECODE_REASONS,
    OutboxDeadLetters,
    StreamRunner,
    decode_keyed,
)
from flywheel.stream.store import StateStore
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from ingest.stage import EPISODES_ARCHIVE, IngestStage
from ingest.stage import SCHEMA as INGEST_SCHEMA
from local.broker import EmbeddedBroker
from reward.report import REWARD_SCHEMA, reward_row, reward_table
from reward.stage import REWARDS_ARCHIVE, RewardStage
from reward.stage import SCHEMA as REWARD_SCHEMA_SQL

#: The benchmarks' join window: the records are stamped a minute in the past and the feedback at
#: its generation's time, so every window is past its deadline and closes WINDOW_S after its
#: generation arrives (ingest/join.py): the stage is measured, not the wait.
WINDOW_S = 0.01


def generation(i: int, tokens: int, t: float) -> GenerationEvent:
    """The benchmarks' ``i``-th generation: ``tokens`` completion tokens, made at ``t``."""
    gid = f"g{i}"
    toks = tuple((i * 7 + j) % 500 for j in range(tokens))
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id=f"u{i % 500}",
        endpoint="chat", created_at=t, completed_at=t, latency_ms=20, prompt_text="a prompt",
        prompt_token_ids=(1, 2, 3, 4), completion_text="x" * (3 * tokens), completion_token_ids=toks,
        logprobs=tuple(-0.5 for _ in toks), sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64),
        finish_reason="stop")


def produce(cfg: KafkaSettings, topics: Topics, pairs: int, tokens: int = 32) -> None:
    producer = make_producer(cfg, "bench", linger_ms=20)
    t = time.time() - 60
    for i in range(pairs):
        g = generation(i, tokens, t)
        f = FeedbackEvent(feedback_id=f"f{i}", generation_id=g.generation_id, signal=("accept", "reject")[i % 2],
                          decision_ms=900.0, created_at=t, received_at=t)
        producer.send(topics.generations, key=g.generation_id, value=encode(g))
        producer.send(topics.feedback, key=g.generation_id, value=encode(f))
    producer.flush()
    producer.close()


def raw_rate(cfg: KafkaSettings, inputs: list[str], expect: int) -> float:
    consumer = make_consumer(cfg, "bench-raw", f"raw-{uuid.uuid4().hex[:6]}", inputs)
    seen, start, cpu, first = 0, None, 0.0, 0
    while seen < expect:
        got = sum(len(r) for r in consumer.poll(timeout_ms=200, max_records=5000).values())
        if got and start is None:
            start, cpu, first = time.perf_counter(), time.process_time(), got
        seen += got
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    consumer.close()
    return (expect - first) / elapsed, (expect - first) / cpu


def relay_rate(cfg: KafkaSettings, inputs: list[str], out: str, expect: int) -> tuple[float, float]:
    """Consume ``inputs`` and send every record on unchanged, collecting each ack: no decode, no state.

    The same loop shape and clients as a stage (consumer group poll, the stages' output producer,
    partitioned by key) without any of a stage's work, so its rate is a ceiling for any stage
    that emits one record per input record in one process.
    """
    consumer = make_consumer(cfg, "bench-relay", f"relay-{uuid.uuid4().hex[:6]}", inputs)
    producer = make_output_producer(cfg, "bench-relay")
    producer.send(-1, out, "warm-up", b"{}")  # metadata and connection before the clock starts
    producer.flush(60)
    producer.reports()
    seen, start, cpu, first = 0, None, 0.0, 0
    while seen < expect:
        got = 0
        for recs in consumer.poll(timeout_ms=200, max_records=5000).values():
            for rec in recs:
                producer.send(seen + got, out, rec.key.decode(), rec.value)
                got += 1
        producer.reports()
        if got and start is None:
            start, cpu, first = time.perf_counter(), time.process_time(), got
        seen += got
    producer.flush(60)
    producer.reports()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    consumer.close()
    producer.close()
    return (expect - first) / elapsed, (expect - first) / cpu


class PassThrough:
    """A :class:`flywheel.stream.runner.Stage` that emits each input record unchanged, optionally after
    validating it as the reward stage does: the exactly-once machinery with no stage logic."""

    def __init__(self, store: StateStore, registry, out: str, topics: Topics, validate: bool) -> None:
        self.store, self.out, self.validate = store, out, validate
        self.dead = OutboxDeadLetters(store, topics.deadletter, "bench", registry, KEYED_DECODE_REASONS)

    def process(self, records, now: float) -> None:
        for rec in records:
            if not self.validate or decode_keyed(EpisodeEvent, rec, self.dead) is not None:
                self.store.append(rec.partition, self.out, rec.key.decode(), rec.value)

    def tick(self, shards: set[int], now: float) -> None:
        return None


def stage_rate(cfg: KafkaSettings, name: str, inputs: list[str], stage_fn, schema: str,
               archives: dict[str, ParquetArchive], expect_in: int, expect_out: int,
               work: Path) -> tuple[float, float]:
    store = StateStore(work / name / "state.sqlite3", schema)
    registry = new_registry()
    stage = stage_fn(store, registry)
    producer = make_output_producer(cfg, name)
    consumer = make_consumer(cfg, name, f"{name}-{uuid.uuid4().hex[:6]}")
    outbox = Outbox(store, producer, archives)
    runner = StreamRunner(stage, store, outbox, consumer, inputs, LagGauge(name, registry), 5000, 200)
    start, cpu, first, delivered = None, 0.0, 0, 0
    while delivered < expect_out:
        if runner.step() and start is None:
            start, cpu, first = time.perf_counter(), time.process_time(), runner.records_in
        delivered = runner.delivered
    runner.finish()  # the clock stops once the archive holds every row too
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    consumer.close()
    producer.close()
    store.close()
    return (expect_in - first) / elapsed, (expect_in - first) / cpu


def median_of(repeat: int, measure, *args) -> tuple[float, float]:
    """The median wall and CPU rates of ``repeat`` runs of ``measure(*args)``: the raw and relay
    runs last a fraction of a second, and one of them alone swings the ratios by a third."""
    runs = [measure(*args) for _ in range(repeat)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def run_client(base: KafkaSettings, client: str, n: int, work: Path, repeat: int,
               tokens: int) -> tuple[list[tuple[str, Rate]], Topics]:
    """Both stages with ``client`` as their output producer, on fresh topics of their own (returned)."""
    cfg = base.model_copy(update={"producer_client": client})
    topics = Topics(f"b{uuid.uuid4().hex[:6]}.")
    ensure_topics(cfg, [*topics.all(), *(f"{topics.prefix}relay{s}" for s in ("", "-eo", "-valid"))])
    produce(cfg, topics, n, tokens)
    inputs = [topics.generations, topics.feedback]
    work = work / client
    rows = [("raw consume (generations+feedback)", median_of(repeat, raw_rate, cfg, inputs, 2 * n))]
    icfg = IngestSettings(window_s=WINDOW_S, grace_s=0)
    rows.append((f"ingest: join -> episodes [{client}]", stage_rate(
        cfg, "ingest", inputs, lambda s, r: IngestStage(icfg, topics, s, r), INGEST_SCHEMA,
        {EPISODES_ARCHIVE: ParquetArchive(work / "episodes", EPISODE_SCHEMA, episode_row, episode_table)},
        2 * n, n, work)))
    rows.append(("raw consume (episodes)", median_of(repeat, raw_rate, cfg, [topics.episodes], n)))
    rows.append((f"reward: label -> rewards [{client}]", stage_rate(
        cfg, "reward", [topics.episodes], lambda s, r: RewardStage(RewardSettings(), topics, s, r),
        REWARD_SCHEMA_SQL, {REWARDS_ARCHIVE: ParquetArchive(work / "rewards", REWARD_SCHEMA, reward_row, reward_table)},
        n, n, work)))
    rows.append((f"relay: consume + send, no work [{client}]",
                 median_of(repeat, relay_rate, cfg, [topics.episodes], f"{topics.prefix}relay", n)))
    for validate, label in ((False, "exactly-once relay, no decode"), (True, "exactly-once relay + validate")):
        out = f"{topics.prefix}relay-{'valid' if validate else 'eo'}"
        rows.append((f"{label} [{client}]", stage_rate(
            cfg, f"pass-{validate}", [topics.episodes],
            lambda s, r, out=out, validate=validate: PassThrough(s, r, out, topics, validate),
            "", {}, n, n, work)))
    return rows, topics


def run_floor(cfg: KafkaSettings, topics: Topics, n: int, work: Path, repeat: int) -> list[tuple[str, Rate, Rate]]:
    """bench/stage_floor.py's rows on the records of :func:`run_client`: ingest's shape on its
    generations and feedback, reward's on the episodes ingest wrote."""
    cfg = cfg.model_copy(update={"producer_client": "confluent"})
    inputs = [topics.generations, topics.feedback]
    return [*floor_rows(cfg, inputs, "raw consume (generations+feedback)", ingest_steps(topics.generations),
                        topics.prefix, 2 * n, work, repeat, lambda: raw_rate(cfg, inputs, 2 * n)),
            *floor_rows(cfg, [topics.episodes], "raw consume (episodes)", REWARD_STEPS, topics.prefix, n, work,
                        repeat, lambda: raw_rate(cfg, [topics.episodes], n))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--clients", default="confluent,kafka-python",
                    help="output producer clients to measure, comma-separated")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each raw and relay measurement; their median is reported")
    ap.add_argument("--tokens", type=int, default=32,
                    help="completion tokens per generation (each with a logprob): decode cost grows with it")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    n = args.pairs
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        cfg = KafkaSettings(bootstrap=broker.bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500,
                            partitions=2)
        runs = {client: run_client(cfg, client, n, Path(tmp), args.repeat, args.tokens)
                for client in args.clients.split(",")}
        # the floor sends with confluent-kafka, whichever client the stages use
        floor = run_floor(cfg, runs["confluent"][1], n, Path(tmp), args.repeat) if "confluent" in runs else []
    print(f"\n{n} generations ({args.tokens} completion tokens) + {n} feedback, 2 partitions, embedded "
          f"broker; raw and relay rows: median of {args.repeat} runs\n")
    # CPU columns: records per CPU-second of this process (all its threads), steadier than wall
    # time when other work shares the cores. Each stage is compared with the raw consume of its
    # own input just before it; the relay with the raw episode consume.
    print(f"{'path':<48}{'records/s':>11}{'vs raw':>8}{'rec/cpu-s':>11}{'vs raw':>8}")
    for block, _ in runs.values():
        for i, (label, (rate, cpu)) in enumerate(block):
            base, cbase = block[0][1] if i < 2 else block[2][1]
            # (a run too short for the CPU clock to tick, as --pairs 500 can be, has no CPU ratio)
            print(f"{label:<48}{rate:>11,.0f}{rate / base:>8.2f}{cpu:>11,.0f}"
                  f"{cpu / cbase if cbase else float('nan'):>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"pairs": n, "clients": {
            client: [{"path": label, "records_per_s": rate, "records_per_cpu_s": cpu} for label, (rate, cpu) in block]
            for client, (block, _) in runs.items()}}, indent=2))
    if floor:
        print(f"\nfloor (bench/stage_floor.py) on the records above: {args.repeat} rounds of a raw consume and "
              "the rows after it; a ratio is the median of each round's row over its raw consume\n")
        for label, (rate, cpu), (ratio, cratio) in floor:
            print(f"{label:<48}{rate:>11,.0f}{ratio:>8.2f}{cpu:>11,.0f}{cratio:>8.2f}")


if __name__ == "__main__":
    main()
