"""A replica whose lease is taken while the group still assigns it the partition asks the group for
a rebalance, and gets the partition back (docs/shared-state.md, the lease protocol).

A process that settles an assignment of a generation the group has already moved past takes
leases the group gives to another member. The member that lost them must not just drop the
partitions: nothing else would assign them again, and they would stay unprocessed. Here the
late taker is the test itself, holding a store of the same namespace: the ingest replica finds
the lease gone at its next turn, rejoins the group, and holds both partitions again, with a
newer term than the taker's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from stream_db import stream_database
from test_pipeline_exactly_once import free_port, stage_env

from flywheel.stream.sql import namespace
from flywheel.stream.store import StateStore
from ingest.stage import SCHEMA as INGEST_SCHEMA

pytestmark = pytest.mark.integration


def _shards(port: int) -> list[int] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return json.load(resp).get("shards")
    except OSError:
        return None


def _until(port: int, want: list[int], timeout_s: float) -> float:
    began = time.monotonic()
    while (got := _shards(port)) != want:
        assert time.monotonic() - began < timeout_s, f"/health shards {got}, waiting for {want}"
        time.sleep(0.1)
    return time.monotonic() - began


@pytest.mark.slow  # a fault run, 10 s  # the default suite must stay under 14 minutes on 2 cores
def test_a_replica_whose_lease_a_late_settle_took_rejoins_and_takes_it_back(kafka_settings, topics, tmp_path):
    group = f"{topics.prefix}ingest"
    with stream_database("postgres", tmp_path, [namespace(group)]) as url:
        port = free_port()
        env = {**os.environ, **stage_env(kafka_settings, topics, tmp_path), "FLYWHEEL_STREAM_DATABASE_URL": url,
               "FLYWHEEL_INGEST_PORT": str(port), "FLYWHEEL_LOG_LEVEL": "INFO"}
        log = tmp_path / "ingest.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ingest.main"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        thief = None
        try:
            _until(port, [0, 1], timeout_s=90)
            thief = StateStore.shared_store(url, namespace(group), INGEST_SCHEMA)
            thief.take([0])  # a late settle elsewhere: the group still gives partition 0 to the replica
            taken = thief.leases[0]
            deadline = time.monotonic() + 60
            while True:  # the replica finds the lease gone at its next turn, rejoins, takes it again
                holder, term = thief.db.execute("SELECT holder, term FROM leases WHERE shard=0").fetchone()
                if holder != thief.holder:
                    break
                assert time.monotonic() < deadline, "the replica never took partition 0 back"
                time.sleep(0.1)
            assert term > taken
            _until(port, [0, 1], timeout_s=30)
            text = log.read_text()
            assert "asking the group for a rebalance" in text, text[-3000:]
            assert proc.poll() is None
        finally:
            if thief is not None:
                thief.close()
            proc.terminate()
            proc.wait(timeout=30)
