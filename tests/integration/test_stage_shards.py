"""Scaling out: a stage as several processes, each owning fixed shards with a data_dir of its own.

Ingest and reward each run as two processes (shard 0 and shard 1) on the real broker while the
messy dataset of test_pipeline_exactly_once streams through and processes are SIGKILLed and
restarted: the topics and the archives (split over the two data_dirs) must still hold exactly the
expected records, and each process must have handled only its own shard.
"""

from __future__ import annotations

import random
import time

import pandas as pd
import pytest
from test_pipeline_exactly_once import Stages, build_dataset, check_outcome, produce, stage_env

from flywheel.settings import SettingsError, load_settings
from ingest.exactly_once import out_partition

pytestmark = pytest.mark.integration


def test_shard_processes_exactly_once_through_kills(kafka_settings, topics, tmp_path):
    env = stage_env(kafka_settings, topics, tmp_path)
    dirs = [tmp_path / "shard0", tmp_path / "shard1"]
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)
    stages = Stages(env, tmp_path)
    for shard, data_dir in enumerate(dirs):
        for stage in ("ingest", "reward"):
            stages.add(f"{stage}-{shard}", stage, {
                "FLYWHEEL_DATA_DIR": str(data_dir), f"FLYWHEEL_{stage.upper()}_SHARDS": str(shard)})
            stages.start(f"{stage}-{shard}")
    rng = random.Random(5)

    def chaos(c: int) -> None:
        if c % 2 == 1:
            time.sleep(rng.uniform(0.0, 0.8))
            stages.kill9(rng.choice(sorted(stages.procs)))

    try:
        produce(kafka_settings, ds, t0, during=chaos)
        time.sleep(1.0)
        stages.kill9("reward-1")
        check_outcome(kafka_settings, topics, ds, dirs, reward_shards=[(0,), (1,)])
    finally:
        stages.stop()
    assert sum(stages.kills.values()) == 5
    for shard, data_dir in enumerate(dirs):
        for archive in ("episodes", "rewards"):
            ids = pd.read_parquet(data_dir / "archive" / archive)["generation_id"]
            assert {out_partition(g, "", kafka_settings.partitions) for g in ids} == {shard}, archive


def test_shard_that_is_not_a_partition_is_refused(kafka_settings, topics, tmp_path):
    from ingest.main import run as run_ingest

    env = {**stage_env(kafka_settings, topics, tmp_path), "FLYWHEEL_INGEST_SHARDS": "1,7"}
    with pytest.raises(SettingsError, match=r"shards \[7\] are not partitions of .*generations"):
        run_ingest(load_settings(env=env), None, stop=_Never())


class _Never:
    def is_set(self) -> bool:
        return False
