"""kill -9 the trainer mid-run, restart it, and prove every sample was trained exactly once.

The trainer runs as a real subprocess (``python -m trainer``) against the session's broker. We
wait until it has trained steps that no durable version contains yet (its /metrics step counter
is ahead of the newest manifest's step), kill -9 it, and start it again. The store's per-version
ledgers must then list every good sample exactly once and every bad record under its reason,
and the dead-letter topic must carry those reasons.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import PYTHON, ROOT, reward_event, trainer_env

from flywheel.contracts import DeadLetterEvent, decode, encode
from flywheel.kafka.clients import make_producer

pytestmark = pytest.mark.integration

N = 96  # 24 steps of 4; a version every 5 steps, so the last steps wait for the 3 s timer


def bad_records() -> dict[str, bytes]:
    nan = json.loads(encode(reward_event(1000)))
    nan["reward"] = math.nan
    long = reward_event(1003, completion=tuple(range(10, 600)), logprobs=tuple([-1.0] * 590))
    return {
        "undecodable": b"{not json",
        "length_mismatch": encode(reward_event(1001, completion=(5, 6, 7), logprobs=(-1.0,))),
        "nan_reward": json.dumps(nan).encode(),
        "unknown_version": encode(reward_event(1002, version=99)),
        "too_long": encode(long),
    }


def start(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "trainer"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def steps_total(log: Path) -> float | None:
    m = re.findall(r"trainer ops on [\d.]+:(\d+)", log.read_text(errors="replace"))
    if not m:
        return None
    body = urllib.request.urlopen(f"http://127.0.0.1:{m[-1]}/metrics", timeout=2).read().decode()
    return float(re.search(r"^trainer_steps_total (\S+)$", body, re.MULTILINE).group(1))


def ledgers(store: Path) -> list[dict]:
    out = []
    for d in sorted(store.glob("v*")):
        out.append(json.loads((d / "ledger.json").read_text()) | {"manifest": json.loads((d / "flywheel-manifest.json").read_text())})
    return out


@pytest.mark.slow  # a fault run, about 17 s on 2 cores (45 s loaded): the default suite must stay under 14 minutes
def test_kill9_and_restart_trains_each_sample_exactly_once(kafka_settings, topics, tiny_model_dir, tmp_path):
    producer = make_producer(kafka_settings, "test")
    for i in range(N):
        producer.send(topics.rewards, key=f"gen-{i}", value=encode(reward_event(i)))
    bad = bad_records()
    for reason, value in bad.items():
        producer.send(topics.rewards, key=f"bad-{reason}", value=value)
    producer.flush()
    producer.close()

    store = tmp_path / "data" / "checkpoints"
    env = trainer_env(kafka_settings, topics.prefix, tiny_model_dir, tmp_path / "data", loss="reinforce",
                      batch_size=4, publish_every_steps=5, publish_every_s=3.0, max_seq_len=256)
    log = tmp_path / "trainer.log"
    first = start(env, log)
    try:
        def unpublished_work():
            versions = ledgers(store) if store.exists() else []
            if len(versions) < 2:
                return None
            durable = versions[-1]["manifest"]["step"]
            live = steps_total(log)
            return live is not None and live > durable
        wait_for(unpublished_work, 120, "steps not yet in a durable version", first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    killed_at = ledgers(store)[-1]["manifest"]

    second = start(env, log)
    try:
        def covered():
            ls = ledgers(store)
            trained = sum(len(x["trained"]) for x in ls)
            dropped = sum(len(v) for x in ls for v in x["dropped"].values())
            return trained + dropped >= N + len(bad)
        wait_for(covered, 120, "every record in a durable version", second)
        time.sleep(1.0)  # a duplicate training would show up in a version right behind
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    text = log.read_text(errors="replace")
    assert f"resumed from version {killed_at['version']} (step {killed_at['step']}" in text

    ls = ledgers(store)
    trained = [g for x in ls for g in x["trained"]]
    assert sorted(trained) == sorted(f"gen-{i}" for i in range(N))  # each exactly once
    dropped = {r: ids for x in ls for r, ids in x["dropped"].items()}
    assert dropped == {reason: [f"bad-{reason}"] for reason in bad}
    assert ls[-1]["manifest"]["samples_total"] == N and ls[-1]["manifest"]["step"] == N // 4

    from tests.conftest import read_all

    reasons = {decode(DeadLetterEvent, r.value).reason for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=len(bad))}
    assert reasons == set(bad)
    announced = read_all(kafka_settings.bootstrap, topics.checkpoints, expect=len(ls))
    assert {json.loads(r.value)["version"] for r in announced} >= {x["manifest"]["version"] for x in ls[1:]}

    from flywheel.checkpoints import CheckpointStore

    CheckpointStore(store).materialize(ls[-1]["manifest"]["version"])  # the chain verifies end to end
    assert os.path.exists(store / f"v{ls[-1]['manifest']['version']:08d}" / "ds")
