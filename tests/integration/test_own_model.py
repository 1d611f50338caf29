"""Your own model, end to end: a sharded Hugging Face directory imports, serves, trains and is released.

A tiny tied-embedding Llama saved in six shards with its tokenizer and chat template (built here:
tests/hf_helpers.py; nothing is downloaded) goes through every role with real parts:

1. ``flywheel model import`` copies it, keeps the shards, and checks it with serving's and the
   trainer's own load checks before writing the manifest;
2. serving starts a real vLLM engine on the sharded directory (every shard verified against the
   manifest first) and answers a chat through the model's own template;
3. the trainer loads it (DeepSpeed on the CPU), takes real steps and publishes v1, consolidated in
   one ``model.safetensors`` with the tied head stored once;
4. the release controller gates v1 against the sharded directory, canaries it (this deployment has
   one engine, so serving refuses the canary routing and says so), measures users who prefer it,
   promotes it by the auto-promote policy and publishes the routing; serving fetches v1, verifies
   it and swaps it into the running engine: its answers are v1's, logprob for logprob;
5. a routing back to version 0 reloads the shards into the same engine.

Slow (about 2-3 minutes on 2 cores: one engine start, a DeepSpeed trainer, the gate's two models).
The default suite holds the parts: the import and its refusals (tests/unit/test_hf_import.py,
tests/integration/test_model_import.py) and sharded weights through manifests, the store, the
delta chain and fetch (tests/unit/test_checkpoint_shards.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_helpers import build_sharded_hf_dir, shards
from serving_helpers import KEY, SALT, Served, _shutdown, generations
from test_release_controller import checkpoint_event, publish_checkpoint, simulate_users, tick_until
from trainer_helpers import make_trainer, reward_event

from cli.main import main as flywheel
from flywheel.checkpoints import manifest
from flywheel.contracts import ReleaseEvent, encode
from flywheel.kafka.clients import make_producer
from flywheel.metrics import new_registry
from flywheel.settings import IngestSettings, ReleaseSettings, ServeSettings, Settings
from release.controller import Controller
from release.gate import DEFAULT_PROMPTS
from release.states import State
from release.store import ReleaseStore
from release.streams import Streams

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Serving:
    """One engine on the imported model, an app on loopback following the releases topic."""

    def __init__(self, model: Path, data_dir: Path, kafka_settings, topics) -> None:
        from serving.app import create_app
        from serving.follow import ReleaseFollower
        from serving.main import make_recorder
        from serving.server import AppServer, LoopThread
        from serving.versions import Fleet

        # fp32, as the model was saved: vLLM's CPU build would serve ``auto`` in bf16, whose rounding
        # (2e-3 nats measured) hides the comparison with the trainer's fp32 logprobs below
        serve = ServeSettings(api_keys=(KEY,), user_id_salt=SALT, version_visible_keys=(KEY,), dtype="float32", max_num_seqs=32, engines=1)
        self.loop = LoopThread()
        self.engine = self.loop.call(lambda: _engine(serve, model), timeout_s=300)
        self.settings = Settings(model_dir=model, data_dir=data_dir, topic_prefix=topics.prefix, kafka=kafka_settings,
                                 serve=serve, release=ReleaseSettings(deployment="flywheel"))
        registry = new_registry()
        self.recorder = make_recorder(self.settings, registry)
        self.follower = ReleaseFollower(self.settings, Fleet([self.engine], registry),
                                        lambda fn: self.loop.call(fn, timeout_s=300), registry)
        self.follower.catch_up(20.0)
        self.follower.start()
        self.server = AppServer(create_app(self.settings, self.follower.fleet, self.recorder, registry,
                                           self.follower), self.loop).start()
        self.served = Served(self.server.url, self.settings, self.recorder, topics)

    def complete(self, prompt: str) -> dict:
        resp = self.served.post("/v1/completions", {"model": "flywheel", "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 1.0, "seed": 7, "user": "someone"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def recorded(self, broker, generation_id: str):
        """The generation event serving recorded for ``generation_id``, once it arrived."""
        deadline = time.monotonic() + 60
        while (ev := generations(broker, self.served, expect=0, repeats_ok=True).get(generation_id)) is None:
            assert time.monotonic() < deadline, f"{generation_id} never recorded"
            time.sleep(0.5)
        return ev

    def close(self) -> None:
        self.server.stop()
        self.follower.stop()
        self.recorder.stop()
        self.loop.call(lambda: _shutdown(self.engine), timeout_s=60)
        self.loop.stop()


async def _engine(serve: ServeSettings, model: Path):  # on the loop the engine will serve from
    from serving.engine import VllmEngine

    return VllmEngine(serve, model)


def first_logprob(model: torch.nn.Module, prompt_ids: tuple[int, ...], token: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt_ids)])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[token].item()


def test_a_sharded_hf_model_imports_serves_trains_and_is_released(broker, kafka_settings, topics, tmp_path,
                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM

    # 1. import
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    model = tmp_path / "model"
    assert flywheel(["model", "import", str(build_sharded_hf_dir(tmp_path / "hf")), str(model)]) == 0
    assert len(shards(model)) == 6 and "model.safetensors" not in manifest.verify_dir(model)["files"]

    # 2. serve the sharded directory, chat through its own template
    serving = Serving(model, tmp_path / "serving", kafka_settings, topics)
    try:
        chat = serving.served.post("/v1/chat/completions", {
            "model": "flywheel", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "user": "u1"})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "flywheel@v0"
        at_v0 = serving.complete("once upon a time")
        chat_ev = serving.recorded(broker, chat.json()["id"])
        assert chat_ev.prompt_text.startswith("<|bos|><|user|>hello<|end|>") and chat_ev.prompt_text.endswith("<|assistant|>")
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()  # the shards, as loaded
        ev0 = serving.recorded(broker, at_v0["id"])
        assert ev0.logprobs[0] == pytest.approx(first_logprob(base, ev0.prompt_token_ids, ev0.completion_token_ids[0]),
                                                abs=1e-3)

        # 3. train: real DeepSpeed steps on the CPU, from the sharded directory
        tr = make_trainer(model, tmp_path / "trainer", loss="reinforce", lr=1e-3, full_every=10)
        tr.start()  # v0: the imported weights, consolidated
        for n in range(2):
            tr._train([reward_event(8 * n + k) for k in range(8)], [("t", 0, 8 * n + k) for k in range(8)])
        tr.publish()
        store = tr.store
        assert store.versions() == [0, 1]
        v1 = store.manifest(1)
        assert [f for f in v1["files"] if f.endswith(".safetensors")] == ["model.safetensors"]
        assert "lm_head.weight" not in v1["tensors"]  # the tied head stored once, as in the shards
        assert v1["tensors"]["model.embed_tokens.weight"] != store.manifest(0)["tensors"]["model.embed_tokens.weight"]

        # 4. release: gate against the sharded directory, canary, users, auto-promote, serving swaps
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(DEFAULT_PROMPTS.read_text().splitlines(keepends=True)[:8]))
        url = f"sqlite:///{tmp_path / 'release.sqlite3'}"
        # each user's outcome read 1 s after their first answer (release/outcomes.py), as the
        # controller tests do: the users below come as episodes, with no ingest before them
        ctl_settings = Settings(model_dir=model, data_dir=tmp_path / "trainer", topic_prefix=topics.prefix,
                                kafka=kafka_settings, ingest=IngestSettings(window_s=0.5, grace_s=0.0),
                                release=ReleaseSettings(
                                    database_url=url, canary_share=0.5, min_events=40, promotion_interval_s=0,
                                    auto_promote=True, gate_max_new_tokens=12, prompts_file=prompts, tick_s=0.1,
                                    lease_ttl_s=30, deadline_s=600, group_id=f"release-{topics.prefix}",
                                    outcome_window_s=0.5))
        rs, streams = ReleaseStore(url), Streams(ctl_settings, new_registry())
        try:
            ctl = Controller(ctl_settings, rs, streams, store)
            publish_checkpoint(kafka_settings, topics, checkpoint_event(store, 1))
            tick_until(ctl, lambda: (c := rs.get(1)) is not None and c.state == State.CANARY, "v1 in canary")
            assert rs.get(1).gate["outcome"] == "pass"
            simulate_users(kafka_settings, topics, stable=0, canary=1, p_stable=0.3, p_canary=0.8, n=120, seed=5)
            tick_until(ctl, lambda: rs.get(1).state == State.PROMOTED, "the automatic promotion")
            tick_until(ctl, lambda: rs.latest_revision().published, "the routing published")
        finally:
            streams.close()
            rs.close()
        wait_for(lambda: (a := serving.follower.applied) is not None and a.stable_version == 1, "serving on v1")
        at_v1 = serving.complete("once upon a time")
        assert at_v1["model"] == "flywheel@v1"
        ev1 = serving.recorded(broker, at_v1["id"])
        assert ev1.model_version == 1
        want = first_logprob(tr.policy.module.eval(), ev1.prompt_token_ids, ev1.completion_token_ids[0])
        assert ev1.logprobs[0] == pytest.approx(want, abs=1e-3)  # the trainer's v1, not the shards
        assert abs(first_logprob(base, ev1.prompt_token_ids, ev1.completion_token_ids[0]) - want) > 1e-3

        # 5. back to version 0: the shards reloaded into the running engine
        producer = make_producer(kafka_settings, "test")
        revision = serving.follower.applied.revision + 1
        producer.send(topics.releases, key=b"flywheel", value=encode(ReleaseEvent(
            revision=revision, stable_version=0, reason="back to the imported model", updated_at=time.time()))).get(10)
        producer.close()
        wait_for(lambda: serving.follower.applied.revision == revision, "serving on v0 again")
        again = serving.complete("once upon a time")
        ev = serving.recorded(broker, again["id"])
        assert again["model"] == "flywheel@v0" and ev.logprobs[0] == pytest.approx(
            first_logprob(base, ev.prompt_token_ids, ev.completion_token_ids[0]), abs=1e-3)
    finally:
        serving.close()
