"""The LoRA trainer as a real process on the real broker: adapter versions published and announced,
a stop and a restart that resumes from the newest adapter, every sample trained exactly once.

``python -m trainer`` with ``trainer.lora_rank`` set reads rewards from the session's broker. It is
stopped (SIGTERM) after its first versions and started again on the same store; more rewards
arrive. Every announcement on the checkpoints topic must name the base (the model directory's
manifest hash), and every announced version must fetch and verify against its announced hash.
Slow: two trainer starts on two cores.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer_crash import ledgers, start, wait_for
from trainer_helpers import send_rewards, trainer_env

from flywheel.checkpoints import CheckpointStore, adapter_of, manifest
from flywheel.checkpoints.fetch import fetch_version
from flywheel.contracts import CheckpointEvent, decode

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def trained(store: Path) -> list[str]:
    return [g for x in ledgers(store) for g in x["trained"]]


def test_lora_trainer_publishes_adapters_over_the_broker_and_resumes_after_a_restart(
        kafka_settings, topics, tiny_model_dir, tmp_path):
    store = tmp_path / "data" / "checkpoints"
    env = trainer_env(kafka_settings, topics.prefix, tiny_model_dir, tmp_path / "data", loss="reinforce", lr=1e-3,
                      lora_rank=4, lora_alpha=8.0, batch_size=4, publish_every_steps=2, publish_every_s=2.0,
                      full_every=3, max_seq_len=256)
    log = tmp_path / "trainer.log"
    send_rewards(kafka_settings, topics.rewards, range(16))
    first = start(env, log)
    try:
        wait_for(lambda: store.exists() and len(trained(store)) == 16, 180, "the first 16 samples durable", first)
    finally:
        stop(first)
    before = ledgers(store)[-1]["manifest"]

    send_rewards(kafka_settings, topics.rewards, range(16, 32))
    second = start(env, log)
    try:
        wait_for(lambda: len(trained(store)) == 32, 180, "all 32 samples durable", second)
    finally:
        stop(second)
    assert f"resumed from version {before['version']} (step {before['step']}" in log.read_text(errors="replace")
    assert sorted(trained(store)) == sorted(f"gen-{i}" for i in range(32))  # each exactly once

    base_sha = manifest.sha256_file(tiny_model_dir / manifest.MANIFEST_NAME)
    mans = [x["manifest"] for x in ledgers(store)]
    assert all(adapter_of(m).base_manifest_sha256 == base_sha for m in mans)
    after = next(m for m in mans if m["version"] == before["version"] + 1)
    assert after["parent"] == before["version"] and after["step"] > before["step"]

    from tests.conftest import read_all

    events = {}
    for rec in read_all(kafka_settings.bootstrap, topics.checkpoints, expect=len(mans)):
        ev = decode(CheckpointEvent, rec.value)
        events[ev.version] = ev
    assert sorted(events) == [m["version"] for m in mans]
    cache = CheckpointStore(tmp_path / "reader-cache")
    for ev in events.values():
        assert ev.base is not None and ev.base.manifest_sha256 == base_sha
        got = fetch_version(ev.uri, ev.version, ev.manifest_sha256, cache)
        assert adapter_of(got.manifest) is not None
        assert json.loads((got.path / "adapter_config.json").read_text())["r"] == 4
