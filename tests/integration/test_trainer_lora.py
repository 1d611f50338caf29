"""LoRA training on DeepSpeed (CPU): real steps on the tiny model change the adapter and never the
base; adapter versions resume, load in the release gate and merge into full weights.

No broker here: the trainer's train and publish paths are driven directly (the broker run is
test_trainer_lora_broker.py). The checks state what a broken mode would show: a base weight that
moved by one bit, an adapter tensor that did not move, a resumed adapter that is not the one
published, logprobs of the published adapter that are not the trainer's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import make_trainer, reward_event

from flywheel.checkpoints import (
    ADAPTER_WEIGHTS,
    WEIGHTS,
    ManifestError,
    adapter_of,
    manifest,
    verify_dir,
)

pytestmark = pytest.mark.integration

LORA = {"loss": "reinforce", "lr": 1e-3, "lora_rank": 4, "lora_alpha": 8.0, "full_every": 3, "keep_full": 1}


def _train(tr, start: int, steps: int) -> int:
    for _ in range(steps):
        tr._train([reward_event(start + k) for k in range(4)], [("t", 0, start + k) for k in range(4)])
        start += 4
    return start


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """v0 (the untrained adapter), then two versions of two real steps each."""
    data = tmp_path_factory.mktemp("lora")
    tr = make_trainer(tiny_model_dir, data, **LORA)
    tr.start()
    i = 0
    for _ in range(2):
        i = _train(tr, i, 2)
        tr.publish()
    return tr, data


def test_lora_steps_change_every_adapter_tensor_and_no_base_weight(run, tiny_model_dir):
    tr, _ = run
    store = tr.store
    base = load_file(str(tiny_model_dir / WEIGHTS))
    live = {k.removeprefix("base_model.model."): v for k, v in tr.policy.module.state_dict().items()
            if "lora_" not in k}
    live = {k.replace(".base_layer", ""): v for k, v in live.items()}
    assert set(base) <= set(live)
    assert all(torch.equal(live[k], base[k]) for k in base), "a base weight moved"
    from safetensors.torch import load

    v0, v2 = load(store.materialize_bytes(0)), load(store.materialize_bytes(2))
    assert set(v0) == set(v2) and len(v0) == 2 * 7 * 2  # A and B of 7 linear layers in 2 blocks
    assert all("lora_A" in k or "lora_B" in k for k in v0)
    assert all(not torch.any(v0[k]) for k in v0 if "lora_B" in k)  # version 0 is the base itself
    unchanged = [k for k in v0 if torch.equal(v0[k], v2[k])]
    assert unchanged == []
    for v in store.versions():
        files = {p.name for p in store.path(v).iterdir()}
        assert WEIGHTS not in files and "config.json" not in files
        assert adapter_of(store.manifest(v)).base_manifest_sha256 == manifest.sha256_file(
            tiny_model_dir / manifest.MANIFEST_NAME)
    assert store.manifest(1)["full_snapshot"] is False and "delta_bytes" in store.manifest(1)


def test_the_optimizer_state_holds_the_adapter_only(run, tiny_model_dir):
    tr, _ = run
    ds = tr.store.path(2) / "ds"
    saved = sum(p.stat().st_size for p in ds.rglob("*") if p.is_file())
    assert 0 < saved < (tiny_model_dir / WEIGHTS).stat().st_size  # a full-model state would be 3x the weights


def test_the_published_adapter_on_its_base_gives_the_trainers_logprobs(run, tiny_model_dir):
    from flywheel.adapters import load_causal_lm
    from trainer.policy import collate, token_logprobs

    tr, _ = run
    events = [reward_event(900 + k) for k in range(4)]
    want = tr.policy.logprobs(events)
    model = load_causal_lm(tr.store.materialize(2), tiny_model_dir).eval()
    b = collate(events, tr.policy.pad_id)
    with torch.no_grad():
        got, _ = token_logprobs(model, b, with_entropy=False)
    base = load_causal_lm(tiny_model_dir, tiny_model_dir).eval()
    with torch.no_grad():
        untrained, _ = token_logprobs(base, b, with_entropy=False)
    mask = b.mask.bool()
    assert (got[mask] - want[mask]).abs().max() < 1e-4
    assert (untrained[mask] - want[mask]).abs().max() > 1e-3  # the adapter moved them: the check can fail


def test_the_gate_scores_an_adapter_version_on_its_base_and_refuses_another(run, tiny_model_dir, tmp_path):
    from flywheel.modelinit import ModelSpec, init_model
    from release.gate import load_prompts, measure_gate

    tr, _ = run
    cand = tr.store.materialize(2)
    prompts = load_prompts(None)[:4]
    m = measure_gate(tiny_model_dir, cand, prompts, max_new_tokens=6, trainer_metrics={}, base_dir=tiny_model_dir)
    assert m.prompts == 4 and m.kl_from_stable > 0
    same = measure_gate(tiny_model_dir, tr.store.materialize(0), prompts, max_new_tokens=6, trainer_metrics={},
                        base_dir=tiny_model_dir)
    assert same.kl_from_stable < 1e-6  # version 0's adapter is zero: the base itself
    other = init_model(tmp_path / "other", ModelSpec(seed=1))
    with pytest.raises(ManifestError, match="another model"):
        measure_gate(other, cand, prompts, max_new_tokens=6, trainer_metrics={}, base_dir=other)


def test_merge_writes_a_verified_full_weight_model_of_the_adapter(run, tiny_model_dir, tmp_path):
    from flywheel.adapters import load_causal_lm
    from flywheel.checkpoints import cli
    from flywheel.settings import Settings, TrainerSettings

    tr, data = run
    out = tmp_path / "merged"
    settings = Settings(model_dir=tiny_model_dir, data_dir=data, trainer=TrainerSettings(**LORA))
    assert cli.run(settings, argparse.Namespace(action="merge", version=2, out=out)) == 0
    man = verify_dir(out)
    assert man["merged"]["base_manifest_sha256"] == adapter_of(tr.store.manifest(2)).base_manifest_sha256
    assert (out / WEIGHTS).exists() and not (out / ADAPTER_WEIGHTS).exists()
    ids = torch.tensor([[1, 20, 40, 11, 12]])
    with torch.no_grad():
        merged = load_causal_lm(out, out)(ids).logits
        adapted = load_causal_lm(tr.store.materialize(2), tiny_model_dir)(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert cli.run(settings, argparse.Namespace(action="merge", version=2, out=out)) == 1  # never overwrites


def test_a_restart_resumes_the_adapter_and_refuses_another_base_or_mode(run, tiny_model_dir, tmp_path):
    from flywheel.modelinit import ModelSpec, init_model

    tr, data = run
    again = make_trainer(tiny_model_dir, data, **LORA)
    again.start()
    assert again.version == 2 and again.step == tr.step
    published = load_file(str(again.store.materialize(2) / ADAPTER_WEIGHTS))
    resumed = again.policy.publish_weights(torch.float32)
    assert set(published) == set(resumed) and all(torch.equal(published[k], resumed[k]) for k in published)
    with pytest.raises(ManifestError, match="another model"):
        make_trainer(init_model(tmp_path / "other", ModelSpec(seed=1)), data, **LORA).start()
    with pytest.raises(ManifestError, match="lora_rank is 0"):
        make_trainer(tiny_model_dir, data, loss="reinforce").start()
