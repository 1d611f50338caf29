"""Replicas on one shared state database (``stream.database_url``, docs/shared-state.md), with the
real broker: two ingest processes in one consumer group with no shard list, one of them SIGKILLed
mid-stream. The survivor takes its partition and that partition's open windows and outbox from the
database; the distinct episodes, rewards and dead letters must be exactly the expected ones, and
the repeats no more than the outbox held when the replica died.

Reward runs as one process with a data_dir of its own (its guards count per process: with two
replicas, the constant-user flags would depend on who held which shard when).
"""

from __future__ import annotations

import random
import time

import pytest
from stream_db import stream_database
from test_pipeline_exactly_once import Stages, build_dataset, check_outcome, produce, stage_env

from flywheel.stream.sql import namespace
from flywheel.stream.store import owed_in

pytestmark = pytest.mark.integration


class Replicas(Stages):
    """Stages whose dead processes' leftovers are counted in the shared database: every row owed
    then (an upper bound of what their successors send again)."""

    def __init__(self, env: dict[str, str], log_dir, url: str, groups: dict[str, str], partitions: int) -> None:
        super().__init__(env, log_dir)
        self.url, self.groups, self.partitions = url, groups, partitions

    def died(self, name: str) -> None:
        module = self.module(name)
        left = owed_in(self.url, self.groups[module], range(self.partitions)) if module in self.groups else 0
        self.leftovers.setdefault(name, []).append(left)


def run_replicas(kafka_settings, topics, tmp_path, backend: str, chunks: int, kills: int) -> None:
    groups = {"ingest": f"{topics.prefix}ingest"}
    with stream_database(backend, tmp_path, [namespace(g) for g in groups.values()]) as url:
        env = stage_env(kafka_settings, topics, tmp_path / "reward")
        t0 = time.time() + 3.0
        ds = build_dataset(topics, chunks=chunks, per_chunk=200, t0=t0)
        stages = Replicas(env, tmp_path, url, groups, kafka_settings.partitions)
        dirs = [tmp_path / "ingest-a", tmp_path / "ingest-b"]
        for name, data_dir in zip(("ingest-a", "ingest-b"), dirs):
            stages.add(name, "ingest", {"FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_STREAM_DATABASE_URL": url})
        stages.add("reward", "reward", {})
        for name in ("ingest-a", "ingest-b", "reward"):
            stages.start(name)
        rng = random.Random(11)
        killed: list[str] = []

        def chaos(c: int) -> None:
            if c % 2 == 1 and len(killed) < kills:
                time.sleep(rng.uniform(0.0, 0.8))  # anywhere in the processing
                victim = rng.choice(["ingest-a", "ingest-b"])
                killed.append(victim)
                stages.kill9(victim)  # (and started again: it rejoins the group, another rebalance)

        try:
            produce(kafka_settings, ds, t0, during=chaos)
            outcome = check_outcome(kafka_settings, topics, ds, [*dirs, tmp_path / "reward"],
                                    settle=stages.wait_delivered, repeats_from={"ingest"})
        finally:
            stages.stop()
        assert len(killed) == kills
        assert outcome.repeats["ingest"] <= stages.may_repeat("ingest"), (outcome.repeats, stages.leftovers)
        # both replicas processed partitions at some point: the state moved between processes
        for data_dir in dirs:
            assert any((data_dir / "archive" / "episodes").glob("hour=*/*.parquet")), data_dir


@pytest.mark.slow  # about 55 s: the default suite must stay under 15 minutes (test_shared_store.py is in it)
@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_killed_replica_s_partitions_and_state_move_to_the_survivor(kafka_settings, topics, tmp_path, backend):
    run_replicas(kafka_settings, topics, tmp_path, backend, chunks=6, kills=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_replicas_killed_again_and_again_lose_nothing(kafka_settings, topics, tmp_path, backend):
    run_replicas(kafka_settings, topics, tmp_path, backend, chunks=14, kills=6)
