"""The user's own verifiers, plugged into the running reward stage through ``reward.plugins``.

A verifier that fails on one episode dead-letters that episode and the stage goes on; a plugin
that cannot be imported stops the stage before it consumes anything, with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from contextlib import closing

import pytest
from conftest import read_all, running, stage_env, stage_settings

from flywheel.contracts import (
    DeadLetterEvent,
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from flywheel.kafka.clients import make_producer

pytestmark = pytest.mark.integration

PLUGIN = """
from reward.labelers import register_verifier

def _says_ok(ep):
    text = ep.generation.completion_text
    if text == "explode":
        raise RuntimeError("scorer refused the input")
    return 1.0 if text.startswith("ok") else None

register_verifier("says_ok", _says_ok)
"""


def episode(gid: str, text: str, t: float) -> EpisodeEvent:
    g = GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id=f"u-{gid}", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=5, prompt_text="p", prompt_token_ids=(1,),
        completion_text=text, completion_token_ids=(2, 3), logprobs=(-0.1, -0.2),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")
    return EpisodeEvent(generation=g, signal="accept", feedback_ids=(f"f-{gid}",), resolved_at=t)


def test_plugin_verifier_labels_and_its_failure_is_one_dead_letter(kafka_settings, topics, tmp_path, monkeypatch):
    from reward.main import run as run_reward

    module = f"flyplug_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_REWARD_PLUGINS=module,
                              FLYWHEEL_REWARD_LABELERS="signal,verifier:says_ok")
    with closing(make_producer(kafka_settings, "test")) as producer, running(run_reward, settings) as stage:
        t = time.time()
        for gid, text in (("a", "ok fine"), ("b", "explode"), ("c", "meh"), ("d", "ok again")):
            producer.send(topics.episodes, key=gid, value=encode(episode(gid, text, t)))
        producer.flush()
        rewards = {r.generation_id: r for r in (decode(RewardEvent, x.value) for x in read_all(
            kafka_settings.bootstrap, topics.rewards, expect=3, timeout_s=60))}
        assert sorted(rewards) == ["a", "c", "d"]
        assert rewards["a"].components == {"signal": 0.75, "verifier_says_ok": 1.0}
        assert rewards["c"].components == {"signal": 0.75}
        (dead,) = [decode(DeadLetterEvent, x.value) for x in read_all(kafka_settings.bootstrap, topics.deadletter,
                                                                     expect=1, timeout_s=30)]
        assert (dead.stage, dead.reason) == ("reward", "labeler_error")
        assert dead.detail == "labeler 'verifier:says_ok': RuntimeError: scorer refused the input"
        assert stage.is_alive()


def test_a_plugin_that_cannot_be_imported_stops_the_stage(kafka_settings, topics, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_REWARD_PLUGINS="flyplug_not_installed"))
    out = subprocess.run([sys.executable, "-m", "reward.main"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "flywheel: reward.plugins: cannot import 'flyplug_not_installed': ModuleNotFoundError" in out.stderr
