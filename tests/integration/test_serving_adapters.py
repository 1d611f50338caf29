"""Adapter versions on ONE engine: real LoRA versions from DeepSpeed steps, a real broker, one real
vLLM engine started with LoRA, serving following releases (serving/adapters.py).

The module starts its own engine (``serve.lora=on``, float32: ``dtype=auto`` runs bfloat16 on a
CPU with AMX, whose rounding alone is above the logprob bound) and one app that follows its own
releases topic; the tests publish releases and wait for serving to apply or refuse them. Every
test counts vLLM's engine processes under this one: adapter swaps must never start another.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_helpers import KEY, SALT, Served
from test_serving_releases import Rig, _events, _start
from trainer_helpers import make_trainer, reward_event

from flywheel.checkpoints import MANIFEST_NAME, CheckpointStore, adapter_of, manifest
from flywheel.contracts import BaseModelRef, RewardEvent, SamplingParams, Topics, VersionRef
from flywheel.kafka.clients import ensure_topics
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings, ReleaseSettings, ServeSettings, Settings
from serving.identity import pseudonymise
from serving.routing import arm_of

# the module's set-up alone (DeepSpeed LoRA steps, an engine of its own) is ~70 s on 2 cores
pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The bound the full-weight serving test holds vLLM's logprob to the trainer's (test_serving_releases).
LOGPROB_BOUND = 1e-3


@pytest.fixture(scope="module")
def lora_trained(tiny_model_dir, tmp_path_factory):
    """Adapter versions 0-3 on the tiny model from real DeepSpeed steps (a step size that moves
    greedy text), and the trainer, whose PEFT policy now holds v3."""
    tr = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("lora-trainer"), loss="reinforce", lr=5e-2,
                      lora_rank=4, lora_alpha=8.0, full_every=2, keep_full=1)
    tr.start()
    i = 0
    for _ in range(3):
        for _ in range(2):
            tr._train([reward_event(i + k) for k in range(8)], [("t", 0, i + k) for k in range(8)])
            i += 8
        tr.publish()
    assert tr.store.versions() == [0, 1, 2, 3] and adapter_of(tr.store.manifest(3)) is not None
    return tr


def engine_processes() -> int:
    """vLLM engine-core processes under this one (each engine runs one)."""
    return sum("EngineCore" in " ".join(_cmd(p)) or "EngineCore" in _name(p)
               for p in psutil.Process().children(recursive=True))


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


class AdapterRig(Rig):
    """The full-weight rig, whose refs name the adapters' base as the controller's do."""

    def ref(self, version: int, store: CheckpointStore | None = None, uri: str | None = None) -> VersionRef | None:
        ref = super().ref(version, store, uri)
        if ref is None:
            return None
        a = adapter_of(manifest.read(Path(uri or (store or self.store).path(version))))
        return ref.model_copy(update={"base": BaseModelRef(name=a.base_name, manifest_sha256=a.base_manifest_sha256)})


@pytest.fixture(scope="module")
def rig(broker, tiny_model_dir, lora_trained, tmp_path_factory):
    from serving.adapters import adapter_slots
    from serving.engine import VllmEngine
    from serving.main import make_recorder
    from serving.server import LoopThread
    from serving.versions import Fleet

    before = engine_processes()
    serve = ServeSettings(api_keys=(KEY,), user_id_salt=SALT, version_visible_keys=(KEY,), max_num_seqs=32, lora="on", dtype="float32")
    loop = LoopThread()

    async def make():
        return VllmEngine(serve, tiny_model_dir, lora=True)

    shared = loop.call(make, timeout_s=300)
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
    ensure_topics(kafka, topics.all())
    settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path_factory.mktemp("serving-lora"),
                        topic_prefix=topics.prefix, kafka=kafka, serve=serve,
                        release=ReleaseSettings(deployment="flywheel"))
    registry = new_registry()
    recorder = make_recorder(settings, registry)
    fleet = Fleet(adapter_slots(shared, tiny_model_dir), registry)
    follower, server = _start(settings, fleet, loop, registry, recorder)
    r = AdapterRig(broker, Served(server.url, settings, recorder, topics), follower, fleet, lora_trained.store, None)
    r.shared, r.loop, r.engines = shared, loop, before + 1
    r.send = lambda value, key="flywheel", **_: r.producer.send(  # unsigned: this serving trusts no key
        topics.releases, key=key.encode(), value=value).get(timeout=10)
    assert engine_processes() == r.engines
    yield r
    server.stop()
    follower.stop()
    recorder.stop()
    r.producer.close()

    async def stop():
        shared.shutdown()

    loop.call(stop, timeout_s=60)
    loop.stop()


def _complete(r: Rig, user: str | None, prompt: str, model: str = "flywheel", **kw) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}
    if user is not None:
        body["user"] = user
    resp = r.served.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- tests ---------------------------------------------------------------------------------------------
def test_stable_and_canary_adapters_answer_side_by_side_sticky_by_user_on_one_engine(rig):
    rig.release(1, 2, 0.5)
    assert rig.health()["versions"] == {"stable": 1, "canary": 2}
    assert {id(s.engine.shared) for s in rig.fleet.slots} == {id(rig.shared)}  # two routes, one engine
    users = [f"person-{i}" for i in range(30)]
    answers = {u: _complete(rig, u, "the same prompt for everyone") for u in users}
    expected = {u: 2 if arm_of(pseudonymise(SALT, u), 0.5) == "canary" else 1 for u in users}
    assert {u: a["model"] for u, a in answers.items()} == {u: f"flywheel@v{v}" for u, v in expected.items()}
    assert 5 < sum(v == 2 for v in expected.values()) < 25  # both arms got users
    again = {u: _complete(rig, u, "another prompt")["model"] for u in users[:10]}
    assert again == {u: answers[u]["model"] for u in users[:10]}  # each user keeps their version
    events = _events(rig, [a["id"] for a in answers.values()])
    for u, a in answers.items():
        ev = events[a["id"]]
        assert ev.model_version == expected[u] and ev.route == ("canary" if expected[u] == 2 else "stable")
        assert ev.version_spans == ()  # the whole sequence is the adapter's: no span of the base's label

    # each route runs its own adapter: greedy text of the base and of the two adapters differs
    prompts = ["once upon a time", "the answer is", "hello there", "a b c d"]
    texts = {v: [_complete(rig, None, p, model=f"flywheel@v{v}")["choices"][0]["text"] for p in prompts]
             for v in (1, 2)}
    rig.release(0)
    texts[0] = [_complete(rig, None, p)["choices"][0]["text"] for p in prompts]
    assert texts[0] != texts[1] != texts[2] != texts[0]
    assert engine_processes() == rig.engines


def test_adapter_swaps_under_load_fail_no_request_and_start_no_engine(rig):
    rig.release(0)
    stop, results, errors = threading.Event(), [], []

    def worker(n: int) -> None:
        with httpx.Client(base_url=rig.served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            i = 0
            while not stop.is_set():
                body = {"model": "flywheel", "prompt": f"load {n} {i}", "max_tokens": 24, "temperature": 1.0,
                        "user": f"load-{n}-{i % 3}", "stream": n % 2 == 1}
                try:
                    resp = c.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    if n % 2 == 0:
                        ch = resp.json()["choices"][0]
                        assert ch["finish_reason"] in ("stop", "length"), ch
                        results.append(resp.json()["id"])
                    else:  # a stream that ended as it should, not cut
                        flat = resp.text.replace(" ", "")
                        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
                        assert '"finish_reason":"length"' in flat or '"finish_reason":"stop"' in flat, resp.text[-300:]
                        results.append(None)
                except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                    errors.append(repr(exc))
                i += 1

    swaps = ((1, None), (1, 2), (2, None), (2, 3), (2, None), (3, None), (0, 3), (0, None))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, n) for n in range(8)]
        time.sleep(1.0)
        # a new stable, a canary, promotion, a new canary, a rollback, promotions in place, back to the base
        for stable, canary in swaps:
            rig.release(stable, canary, 0.5 if canary else 0.0)
            assert engine_processes() == rig.engines
            time.sleep(0.4)
        stop.set()
        for f in futures:
            f.result()
    assert errors == [] and len(results) > 40
    ids = [x for x in results if x]
    events = _events(rig, ids)
    assert {events[i].model_version for i in ids} <= {0, 1, 2, 3}
    assert all(events[i].finish_reason in ("stop", "length") for i in ids)

    # every replaced adapter leaves the engine once its last request ended: what stays is what the
    # slots hold (the idle slot keeps v3 after the rollback, ready to be routed to again)
    deadline = time.monotonic() + 30
    while any(s.engine.retiring for s in rig.fleet.slots):
        assert time.monotonic() < deadline, "a replaced adapter was never removed"
        time.sleep(0.1)
    loaded = rig.loop.call(lambda: rig.shared._llm.list_loras(), timeout_s=30)
    held = {s.engine._lora.lora_int_id for s in rig.fleet.slots if s.engine._lora is not None}
    assert set(loaded) == held and len(held) == 1 and sorted(s.version for s in rig.fleet.slots) == [0, 3]


def test_an_adapter_with_a_flipped_byte_or_a_wrong_hash_or_another_base_is_refused(rig, lora_trained, tmp_path):
    rig.release(1)
    src = lora_trained.store.path(3)
    tampered = CheckpointStore(tmp_path / "tampered")
    shutil.copytree(src, tampered.path(3))
    weights = tampered.path(3) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor's last value
    weights.write_bytes(bytes(data))
    good = rig.ref(3, uri=str(src))
    cases = [
        ("verification_failed", good.model_copy(update={"uri": str(tampered.path(3))})),
        ("manifest_mismatch", good.model_copy(update={"manifest_sha256": hashlib.sha256(b"other").hexdigest()})),
        ("wrong_base", good.model_copy(update={"base": BaseModelRef(name="other", manifest_sha256="c" * 64)})),
    ]
    for reason, ref in cases:
        before = rig.follower.metrics.refused.labels(reason)._value.get()
        revision = rig.release(1, 3, 0.5, wait=False, canary_ref=ref)
        rig.wait_for(lambda rv=revision: rig.follower.refused_revision == rv)
        assert rig.follower.last_refusal["reason"] == reason, rig.follower.last_refusal
        assert rig.follower.metrics.refused.labels(reason)._value.get() == before + 1
        assert rig.health()["versions"] == {"stable": 1}  # still serving what it served
        assert not rig.follower.cache.path(3).exists() or (rig.follower.cache.path(3) / MANIFEST_NAME).exists()
    # a sound release after them applies
    rig.release(1, 3, 0.5)
    assert rig.health()["versions"] == {"stable": 1, "canary": 3}
    assert engine_processes() == rig.engines


def test_vllms_logprobs_of_an_adapter_version_are_the_trainers_within_the_full_weight_bound(rig, lora_trained):
    """The trainer's PEFT policy holds v3: it scores what serving sampled with v3's adapter, as it
    scores a generation when it trains on it (trainer.policy.collate + token_logprobs)."""
    from trainer.policy import collate, token_logprobs

    rig.release(0, 3, 0.5)
    ids = [_complete(rig, None, p, model="flywheel@v3", temperature=1.0, seed=7 + k, max_tokens=12,
                     ignore_eos=True)["id"] for k, p in enumerate(["once upon a time", "the answer is", "hello"])]
    events = _events(rig, ids)
    rewards = []
    for i in ids:
        ev = events[i]
        assert ev.model_version == 3 and ev.route == "pinned" and len(ev.logprobs) == 12
        rewards.append(RewardEvent(
            generation_id=ev.generation_id, group_id=ev.group_id, user_id="u", model_version=ev.model_version,
            signal="accept", prompt_token_ids=ev.prompt_token_ids, completion_token_ids=ev.completion_token_ids,
            logprobs=ev.logprobs, sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=12), reward=1.0,
            generated_at=0.0, labeled_at=0.0))
    policy = lora_trained.policy
    policy.engine.eval()
    b = collate(rewards, policy.pad_id)
    with torch.no_grad():
        trainer_lp, _ = token_logprobs(policy.engine, b, with_entropy=False)
        with policy.module.disable_adapter():  # the same batch on the base alone
            base_lp, _ = token_logprobs(policy.module, b, with_entropy=False)
    mask = b.mask.bool()
    served = torch.zeros_like(trainer_lp)
    for row, ev in enumerate(events[i] for i in ids):
        served[row][mask[row]] = torch.tensor(ev.logprobs, dtype=served.dtype)
    gap = (trainer_lp[mask] - served[mask]).abs()
    assert gap.max().item() < LOGPROB_BOUND, gap
    assert (base_lp[mask] - served[mask]).abs().max().item() > 10 * LOGPROB_BOUND  # the adapter is in play
    assert engine_processes() == rig.engines
