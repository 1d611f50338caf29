"""Scaling out: a stage as several processes, each owning fixed shards with a data_dir of its own.

Ingest and reward each run as two processes (shard 0 and shard 1) on the real broker while the
messy dataset of test_pipeline_exactly_once streams through and processes are SIGKILLed and
restarted: the distinct records on the topics and the archives (split over the two data_dirs)
must still be exactly the expected ones, repeats on the topics no more than the killed processes
left in their outboxes, and each process must have handled only its own shard. Processes whose stores
differ and whose shards overlap are refused by the shard claims (flywheel/stream/claims.py).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pandas as pd
import pytest
from test_pipeline_exactly_once import Stages, build_dataset, check_outcome, produce, stage_env

from flywheel.settings import SettingsError, load_settings

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a fault run, about 18 s on 2 cores: the default suite must stay under 14 minutes
def test_shard_processes_exactly_once_through_kills(kafka_settings, topics, tmp_path):
    """Two processes per stage, each on one shard with a data_dir of its own, SIGKILLed at random:
    the distinct outcome is exact (the reward guards count per process), repeats come only from
    stages that had a process killed and number at most the rows those processes left in their
    outboxes, and each process archived only its own shard, each row once. A record's shard is
    read from the topic itself (the episodes partition its generation_id went to), which
    check_outcome also holds each reward to."""
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
        outcome = check_outcome(kafka_settings, topics, ds, dirs, reward_shards=[(0,), (1,)],
                                settle=stages.wait_delivered,
                                repeats_from={stages.module(name) for name in stages.kills})
    finally:
        stages.stop()
    assert sum(stages.kills.values()) == 5
    for stage in ("ingest", "reward"):
        assert outcome.repeats[stage] <= stages.may_repeat(stage), (stage, outcome.repeats, stages.leftovers)
    for shard, data_dir in enumerate(dirs):
        for archive in ("episodes", "rewards"):
            ids = pd.read_parquet(data_dir / "archive" / archive)["generation_id"]
            assert ids.is_unique, (shard, archive)
            assert {outcome.partition_of[g] for g in ids} == {shard}, archive


def test_shard_that_is_not_a_partition_is_refused(kafka_settings, topics, tmp_path):
    from ingest.main import run as run_ingest

    env = {**stage_env(kafka_settings, topics, tmp_path), "FLYWHEEL_INGEST_SHARDS": "1,7"}
    with pytest.raises(SettingsError, match=r"shards \[7\] are not partitions of .*generations"):
        run_ingest(load_settings(env=env), None, stop=_Never())


class _Never:
    def is_set(self) -> bool:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int, timeout_s: float = 60.0, until=lambda health: True) -> dict:
    """The stage's /health once it answers and ``until(health)`` holds (the ops server starts
    before the loop's first turn has set up the shards it was granted)."""
    deadline, health = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                health = json.load(resp)
            if until(health):
                return health
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health on port {port}: {health}")


@pytest.mark.slow  # 11 s: the default suite must stay under 15 minutes on 2 cores
def test_colliding_processes_are_refused(kafka_settings, topics, tmp_path):
    """A second process with another store and overlapping shards stops with the reason, in
    either mode, and the first one keeps its shards."""
    env = {**os.environ, **stage_env(kafka_settings, topics, tmp_path), "FLYWHEEL_LOG_LEVEL": "INFO"}
    port = _free_port()
    cmd = [sys.executable, "-m", "ingest.main"]
    holder = subprocess.Popen(cmd, env={**env, "FLYWHEEL_DATA_DIR": str(tmp_path / "a"),
                                        "FLYWHEEL_INGEST_SHARDS": "0,1", "FLYWHEEL_INGEST_PORT": str(port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health = _healthy(port, until=lambda h: h["shards"])
        assert health["shards"] == [0, 1] and health["claims"] == "granted"
        for name, extra in (("b", {"FLYWHEEL_INGEST_SHARDS": "1"}), ("c", {})):  # shards / consumer group
            other = subprocess.run(cmd, env={**env, "FLYWHEEL_DATA_DIR": str(tmp_path / name), **extra},
                                   capture_output=True, text=True, timeout=120, check=False)
            assert other.returncode == 2, other.stderr[-2000:]
            assert "collides with store" in other.stderr and "(shards 0,1)" in other.stderr
        assert holder.poll() is None and _healthy(port)["ok"]
    finally:
        holder.terminate()
        holder.wait(timeout=30)


def test_unanswered_claim_runs_unverified_then_obeys_the_verdict(kafka_settings, topics):
    """A group that has not answered does not keep a stage down; its verdict applies when it comes."""
    from flywheel.stream.claims import ShardClaims

    claims = ShardClaims(kafka_settings, "ingest", f"{topics.prefix}ingest", [topics.generations], "e1", (0,))
    try:
        claims.wait_granted(timeout_s=0)  # no time to join: runs unverified
        assert claims.state == "unverified"
        assert claims.assignor.verdicts.wait(60)  # the group answers later: the verdict applies
        claims.check()
        assert claims.state == "granted"
    finally:
        claims.close()


def test_a_stop_ends_the_wait_for_a_verdict(broker, kafka_settings, topics):
    """A process told to stop while its claim waits (a rollout, a crash loop, a broker that does
    not answer) stops there: False, nothing granted, without waiting out the group's answer."""
    from flywheel.stream.claims import ShardClaims

    stop = threading.Event()
    claims = ShardClaims(kafka_settings, "ingest", f"{topics.prefix}ingest", [topics.generations], "e1", (0,))
    broker.pause()  # the group cannot answer (it holds a join for seconds anyway): only the stop ends the wait
    try:
        assert not claims.assignor.verdicts.is_set()
        threading.Timer(0.5, stop.set).start()
        began = time.monotonic()
        assert claims.wait_granted(stop, timeout_s=60) is False
        assert 0.4 < time.monotonic() - began < 1.5 and claims.state == "unverified"
    finally:
        broker.resume()
        claims.close()


def test_a_copy_of_a_store_on_another_machine_is_refused(kafka_settings, topics, monkeypatch):
    """A data_dir copied (or restored) onto another host keeps its store's epoch: both copies
    would number their outputs alike, so the second is refused like another store."""
    from flywheel.stream import claims as claims_module
    from flywheel.stream.claims import ShardClaims, ShardConflict

    group = f"{topics.prefix}ingest"
    first = ShardClaims(kafka_settings, "ingest", group, [topics.generations], "e1", (0, 1))
    try:
        first.wait_granted(timeout_s=60)
        monkeypatch.setattr(claims_module.socket, "gethostname", lambda: "elsewhere")
        copy = ShardClaims(kafka_settings, "ingest", group, [topics.generations], "e1", (1,))
        try:
            with pytest.raises(ShardConflict, match="The same store runs on another machine"):
                copy.wait_granted(timeout_s=60)
            assert first.state == "granted"
        finally:
            copy.close()
    finally:
        first.close()


#: A claims-group member on a host named "elsewhere", run as its own process so that it can die
#: without leaving the group: argv is the Kafka settings (JSON), the group and the input topic.
_FAR_HOLDER = """
import socket, sys, time
from flywheel.settings import KafkaSettings
from flywheel.stream.claims import ShardClaims
socket.gethostname = lambda: "elsewhere"
claims = ShardClaims(KafkaSettings.model_validate_json(sys.argv[1]), "ingest", sys.argv[2], [sys.argv[3]], "e1", (0, 1))
claims.wait_granted(timeout_s=60)
print(claims.state, flush=True)
time.sleep(600)
"""


def test_a_moved_store_starts_once_its_dead_predecessors_session_expires(kafka_settings, topics):
    """A store whose last process died on another machine (its volume moved here) is granted:
    the group's join waits for every member to rejoin, so the verdict comes once the dead
    member's session has expired, without its claim."""
    from flywheel.stream.claims import ShardClaims

    group = f"{topics.prefix}ingest"
    far = subprocess.Popen([sys.executable, "-c", _FAR_HOLDER, kafka_settings.model_dump_json(), group,
                            topics.generations], stdout=subprocess.PIPE, text=True)
    try:
        assert far.stdout.readline().strip() == "granted"
        far.kill()  # no leave: the group keeps its claim until its session expires
        far.wait(timeout=30)
        moved = ShardClaims(kafka_settings, "ingest", group, [topics.generations], "e1", (1,))
        try:
            moved.wait_granted(timeout_s=60)  # raises ShardConflict if the dead claim is judged
            assert moved.state == "granted"
        finally:
            moved.close()
    finally:
        far.kill()
        far.wait(timeout=30)
