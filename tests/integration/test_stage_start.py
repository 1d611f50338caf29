"""A stage started while the broker does not answer waits for it instead of exiting."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import stage_env

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stage", ["ingest", pytest.param("reward", marks=pytest.mark.slow)])
def test_a_stage_started_while_the_broker_is_down_waits_for_it(broker, kafka_settings, topics, tmp_path, stage):
    """A cluster restart can bring the stages up before the broker: each used to exit with a
    traceback after its first bootstrap timed out, to be restarted in a loop by its supervisor.
    (Both start through ingest/runner.py's serve_stage: the reward run is in the slow suite.)"""
    log = tmp_path / f"{stage}.log"
    broker.pause()
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", f"{stage}.main"], stdout=out, stderr=subprocess.STDOUT,
                                    env={**stage_env(kafka_settings, topics, tmp_path), "PATH": ""})
        deadline = time.monotonic() + 90
        while "the broker does not answer at start" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no word of the broker in the log"
            time.sleep(0.5)
    finally:
        broker.resume()
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / stage / "state.sqlite3").exists():  # past the topics: the store opens
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the stage did not go on once the broker answered"
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
