"""Replicas that move: a stage as several processes sharing one state database, killed at random.

With ``stream.database_url`` set, every replica of a stage joins the stage's consumer group with
no shard list, and its state (join windows, dedupe ids, guard counts, outbox, archive queue,
input offsets) lives in the shared database keyed by partition (docs/stream-runtime.md, "Scaling
out"). Three ingest and two reward replicas run on six partitions while the messy dataset of
test_pipeline_exactly_once streams through; one replica at a time is SIGKILLed, the survivors'
takeover of its partitions is timed from their ``/health``, and a replacement (with a fresh
data_dir: another machine) joins. Every replica writes its archives under one ``archive.root``
(a volume they all mount). At the end the distinct episodes, rewards and dead letters are
exactly the expected ones, repeats on the topics are no more than the rows the killed replicas'
partitions still owed, and the shared archives hold each row once: a replica killed between an
archive file's rename and its dequeue leaves rows its successor finds there. Run on the real
PostgreSQL and on SQLite files the processes share.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import statistics
import threading
import time
import uuid

import pytest
from test_pipeline_exactly_once import (
    Stages,
    build_dataset,
    check_outcome,
    ops_get,
    produce,
    stage_env,
)

from flywheel.contracts import Topics
from flywheel.kafka.clients import ensure_topics
from flywheel.stream.store import owed_in

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

PARTITIONS = 6
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def wide(kafka_settings, topic_prefix):
    """Kafka settings and fresh topics with six partitions: room for three replicas to share."""
    settings = kafka_settings.model_copy(update={"partitions": PARTITIONS, "producer_client": "confluent"})
    topics = Topics(topic_prefix)
    ensure_topics(settings, topics.all())
    return settings, topics


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request, tmp_path):
    """A state database of the test's own: a fresh PostgreSQL database (dropped afterwards), or
    SQLite files in a folder the processes share."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'stream-state'}"
        return
    import psycopg

    name = f"flywheel_failover_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def health(port: int) -> dict | None:
    try:
        return json.loads(ops_get(port, "/health"))
    except (OSError, ValueError):
        return None


class Replicas(Stages):
    """Stages whose processes are replicas: ``<stage>-<n>``, each start with a data_dir of its own."""

    def __init__(self, env: dict[str, str], tmp_path, counts: dict[str, int]) -> None:
        super().__init__(env, tmp_path)
        self.tmp_path, self.starts, self.dirs = tmp_path, 0, []
        for stage, n in counts.items():
            for i in range(n):
                self.add(f"{stage}-{i}", stage, {})
        self.shards: dict[str, list[int]] = {}  # name -> the shards its /health last showed

    def start(self, name: str) -> None:
        self.starts += 1
        data_dir = self.tmp_path / f"{name}.{self.starts}"
        self.dirs.append(data_dir)
        module, env = self.specs[name]
        self.specs[name] = (module, {**env, "FLYWHEEL_DATA_DIR": str(data_dir)})
        super().start(name)

    def of(self, stage: str) -> list[str]:
        return sorted(n for n in self.procs if self.module(n) == stage)

    def covered(self, stage: str, without: str | None = None) -> bool:
        """Every partition is owned by a live replica of ``stage`` (other than ``without``)."""
        owned: list[int] = []
        for name in self.of(stage):
            if name != without and self.procs[name].poll() is None and (h := health(self.ports[name])):
                self.shards[name] = h.get("shards", [])
                owned += self.shards[name]
        return sorted(owned) == list(range(PARTITIONS))

    def wait_covered(self, stage: str, without: str | None = None, timeout_s: float = 60.0) -> float:
        began = time.monotonic()
        while not self.covered(stage, without):
            assert time.monotonic() - began < timeout_s, f"{stage}: partitions not covered: {self.shards}"
            time.sleep(0.05)
        return time.monotonic() - began

    def died(self, name: str) -> None:
        pass  # leftovers are counted by the test, from the shared database


@pytest.mark.slow  # about 2 minutes a database: kills, takeovers and a 16-chunk stream
def test_replicas_take_over_killed_ones_with_nothing_lost(wide, database_url, tmp_path):
    kafka, topics = wide
    shared = tmp_path / "shared"  # the volume every replica mounts: its archive/ is their archive.root
    env = stage_env(kafka, topics, tmp_path, FLYWHEEL_STREAM_DATABASE_URL=database_url,
                    FLYWHEEL_KAFKA_PARTITIONS=str(PARTITIONS), FLYWHEEL_ARCHIVE_ROOT=str(shared / "archive"))
    groups = {"ingest": env["FLYWHEEL_INGEST_GROUP_ID"], "reward": env["FLYWHEEL_REWARD_GROUP_ID"]}
    stages = Replicas(env, tmp_path, {"ingest": 3, "reward": 2})
    for name in sorted(stages.specs):
        stages.start(name)
    for stage in groups:
        stages.wait_covered(stage, timeout_s=120)
    t0 = time.time() + 2.0
    ds = build_dataset(topics, chunks=16, per_chunk=200, t0=t0)
    rng = random.Random(11)
    takeovers: dict[str, list[float]] = {"ingest": [], "reward": []}
    leftovers: dict[str, int] = {"ingest": 0, "reward": 0}
    done = threading.Event()
    failures: list[BaseException] = []

    def chaos() -> None:
        try:
            for k in itertools.count():
                if done.wait(rng.uniform(0.5, 1.5)):
                    return
                stage = ("ingest", "reward")[k % 2]
                stages.wait_covered(stage)  # the last replacement has joined, or was left none
                holders = [name for name in stages.of(stage) if stages.shards.get(name)]
                victim = rng.choice(holders)  # one that holds partitions: its death moves them
                shards = list(stages.shards[victim])
                stages.procs[victim].kill()
                stages.procs[victim].wait()
                stages.kills[victim] += 1
                leftovers[stage] += owed_in(database_url, groups[stage], shards)
                takeovers[stage].append(stages.wait_covered(stage, without=victim))
                stages.start(victim)  # the replacement, on another "machine"
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failures.append(exc)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        produce(kafka, ds, t0)
        time.sleep(1.0)
        # A kill and its takeover take about 5 s, so a fast run's 16 s stream sees three or four:
        # the kills go on (open windows, outboxes and archive queues still move) until each stage
        # has had two.
        deadline = time.monotonic() + 60
        while not failures and time.monotonic() < deadline and min(
                sum(n for name, n in stages.kills.items() if stages.module(name) == stage) for stage in groups) < 2:
            time.sleep(0.2)
        done.set()
        thread.join(timeout=120)
        assert not failures, failures
        outcome = check_outcome(kafka, topics, ds, [shared],
                                reward_shards="moving",
                                settle=stages.wait_delivered, repeats_from={"ingest", "reward"})
    finally:
        done.set()
        stages.stop()
    assert not [f for d in stages.dirs for f in d.rglob("*.parquet")]  # all of it in the shared root
    kills = {stage: sum(n for name, n in stages.kills.items() if stages.module(name) == stage) for stage in groups}
    log.info("kills %s; takeover s %s; leftovers %s; repeats %s", kills, takeovers, leftovers, dict(outcome.repeats))
    assert kills["ingest"] >= 2 and kills["reward"] >= 2, kills
    for stage in groups:
        assert outcome.repeats[stage] <= leftovers[stage], (stage, outcome.repeats, leftovers)
    every = sorted(t for ts in takeovers.values() for t in ts)
    print(f"takeover after kill -9 ({database_url.split(':')[0]}, session {kafka.session_timeout_ms} ms): "
          f"p50 {statistics.median(every):.2f} s, p95 {every[min(len(every) - 1, int(0.95 * len(every)))]:.2f} s, "
          f"n {len(every)}")
