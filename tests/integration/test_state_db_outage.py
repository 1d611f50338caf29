"""The stream stages on a PostgreSQL state database whose connections are ended again and again
mid-stream (what a server restart or a failover does to them), with the real broker: ingest and
reward keep running (the same processes, never restarted), reconnect, and the distinct episodes,
rewards and dead letters are exactly the expected ones, the reward guards' counts included (a
cache that kept a failed batch's counts would flag the constant user's samples early).
"""

from __future__ import annotations

import random
import time
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from stream_db import STREAM_TEST_POSTGRES_URL, stream_database, throwaway_database
from test_pipeline_exactly_once import Stages, build_dataset, check_outcome, produce, stage_env

from flywheel.stream.sql import namespace

pytestmark = pytest.mark.integration


@pytest.mark.slow  # about 20 s: the default suite must stay under 15 minutes (test_state_db_reconnect.py is in it)
def test_stages_ride_out_their_database_connections_ended_mid_stream(kafka_settings, topics, tmp_path):
    groups = [f"{topics.prefix}ingest", f"{topics.prefix}reward"]
    with stream_database("postgres", tmp_path, [namespace(g) for g in groups]) as url:
        # the test's own backends only: stream_database names them with an application_name
        tag = parse_qs(urlsplit(url).query)["application_name"][0]
        env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_STREAM_DATABASE_URL=url)
        stages = Stages(env, tmp_path)
        for name in ("ingest", "reward"):
            stages.start(name)
        pids = {name: proc.pid for name, proc in stages.procs.items()}
        rng = random.Random(5)
        ended: list[int] = []
        admin = psycopg.connect(STREAM_TEST_POSTGRES_URL, autocommit=True)
        backends = "FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()"
        deadline = time.monotonic() + 60
        # both stores open (two connections each) before the stream starts: a slow start must
        # not let the cuts fall before there is anything to cut
        while admin.execute(f"SELECT count(*) {backends}", (tag,)).fetchone()[0] < 4:
            assert time.monotonic() < deadline, "the stages did not open their state stores"
            time.sleep(0.2)
        t0 = time.time() + 3.0
        ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)

        def cut(c: int) -> None:
            if c % 2 == 1:
                time.sleep(rng.uniform(0.0, 0.8))  # anywhere in the processing
                ended.append(len(admin.execute(f"SELECT pg_terminate_backend(pid) {backends}", (tag,)).fetchall()))

        try:
            produce(kafka_settings, ds, t0, during=cut)
            outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered,
                                    repeats_from={"ingest", "reward"})
            assert {name: proc.pid for name, proc in stages.procs.items() if proc.poll() is None} == pids
        finally:
            admin.close()
            stages.stop()
        # each cut ended both stages' connections (a batch's and the sequence numbers')
        assert len(ended) == 4 and all(n >= 4 for n in ended), ended
        for name in ("ingest", "reward"):
            log = (tmp_path / f"{name}.log").read_text()
            assert log.count("the state database failed a turn") >= 2, name
        # repeats come only from acked rows whose delete was cut off, and sends in flight: a few
        assert sum(outcome.repeats.values()) <= 4 * 2 * 200 * 3, outcome.repeats


@pytest.mark.slow  # about 25 s: test_state_db_errors.py holds the same for ingest alone in the default suite
def test_stages_ride_out_their_database_turning_read_only_mid_stream(kafka_settings, topics, tmp_path):
    """What a failover to a server that is still a standby does: the database refuses every write
    for seconds, then writes again with nobody ending the stages' sessions (begun read-only, they
    stay so: the stages must open new ones). Both stages stay up, say so, and the distinct
    episodes, rewards and dead letters are exactly the expected ones."""
    with throwaway_database() as (url, admin, name):
        env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_STREAM_DATABASE_URL=url)
        stages = Stages(env, tmp_path)
        for stage in ("ingest", "reward"):
            stages.start(stage)
        pids = {stage: proc.pid for stage, proc in stages.procs.items()}
        deadline = time.monotonic() + 60
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)).fetchone()[0] < 4:
            assert time.monotonic() < deadline, "the stages did not open their state stores"
            time.sleep(0.2)
        t0 = time.time() + 3.0
        ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)

        def flip(c: int) -> None:
            if c == 1:
                admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            elif c == 5:
                admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')

        try:
            produce(kafka_settings, ds, t0, during=flip)
            outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered,
                                    repeats_from={"ingest", "reward"})
            assert {stage: proc.pid for stage, proc in stages.procs.items() if proc.poll() is None} == pids
        finally:
            stages.stop()
        for stage in ("ingest", "reward"):
            lines = [line for line in (tmp_path / f"{stage}.log").read_text().splitlines() if "25006" in line]
            assert len(lines) == 1 and "the state database failed a turn" in lines[0], (stage, lines)
        assert sum(outcome.repeats.values()) <= 2 * 8 * 200 * 3, outcome.repeats
