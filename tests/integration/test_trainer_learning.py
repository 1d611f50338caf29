"""The policy learns through the trainer's primitives, regularisation prevents collapse, and the
off-policy correction responds to perturbed behaviour logprobs as the maths says.

Real DeepSpeed steps on the CPU with the tiny Llama; samples are drawn from the trainer's own
policy with torch (``Policy.sample``), scored by a synthetic reward, and trained with
``forward_backward`` + ``step``. The reward is the share of completion tokens in a fixed set of 16
token ids (about 3% of the vocabulary, so the initial reward is ~0.03).

Statistical reasoning: seeds are fixed, and the margins are wide. Over 50 steps at lr 3e-3 the
unregularised REINFORCE run ends with a per-token entropy around 0.4 nats (from 6.2: collapse onto a
few tokens of the set), while the default entropy bonus + KL keeps it around 3-5 nats; the asserted
floor (2.0) and collapse ceiling (1.2) sit far from both. The target-set probability rises several
fold in both runs; we assert at least 3x.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flywheel.contracts import RewardEvent, SamplingParams

pytestmark = pytest.mark.integration

TARGET = frozenset(range(100, 116))
PROMPTS = [[1, 4, 30 + i % 5] for i in range(16)]
ENTROPY_FLOOR = 2.0
COLLAPSED = 1.2


@pytest.fixture(autouse=True)
def one_thread():
    """The trainer's CPU default (TrainerSettings.cpu_threads = 1), restored afterwards: with other
    processes on the same cores, OpenMP spin-waiting makes 2 threads several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load(model_dir, *, loss="reinforce", entropy=0.01, kl=0.02, lr=3e-3):
    from trainer import dist
    from trainer.losses import LossConfig
    from trainer.policy import Policy, default_ds_config

    dist.init()
    torch.manual_seed(0)
    return Policy.load(model_dir, default_ds_config(16, 1), LossConfig(name=loss, entropy_coef=entropy, kl_coef=kl), lr=lr)


def events_from(samples, step: int) -> list[RewardEvent]:
    return [
        RewardEvent(
            generation_id=f"g{step}-{i}", group_id=f"p{i % 4}", user_id="u", model_version=0, signal="accept",
            prompt_token_ids=tuple(p), completion_token_ids=tuple(t), logprobs=tuple(lp),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),
            reward=sum(x in TARGET for x in t) / len(t), generated_at=0.0, labeled_at=0.0,
        )
        for i, (p, (t, lp)) in enumerate(zip(PROMPTS, samples))
    ]


@torch.no_grad()
def target_mass(policy) -> float:
    """Mean next-token probability of the target set after each prompt."""
    logits = policy.module(input_ids=torch.tensor(PROMPTS, device=policy.device)).logits[:, -1].float()
    return float(logits.softmax(-1)[:, sorted(TARGET)].sum(-1).mean())


def train(policy, steps: int) -> list[dict]:
    history = []
    for step in range(steps):
        history.append(policy.forward_backward(events_from(policy.sample(PROMPTS, max_new_tokens=8), step)))
        policy.step()
    return history


def test_learns_moves_every_parameter_and_regularisation_prevents_collapse(tiny_model_dir):
    reg = load(tiny_model_dir)
    before = {k: v.detach().clone() for k, v in reg.module.named_parameters()}
    mass0 = target_mass(reg)
    hist = train(reg, 50)
    assert target_mass(reg) > 3 * mass0
    assert sum(h["reward_mean"] for h in hist[-10:]) / 10 > 3 * hist[0]["reward_mean"] + 0.1
    frozen = [k for k, v in reg.module.named_parameters() if v.requires_grad and torch.equal(v, before[k])]
    assert frozen == []  # every trainable tensor moved (fp32 master weights)
    reg_entropy = sum(h["entropy"] for h in hist[-5:]) / 5
    assert reg_entropy > ENTROPY_FLOOR
    assert all(h["kl"] > 0 for h in hist[1:])

    bare = load(tiny_model_dir, entropy=0.0, kl=0.0)
    mass0 = target_mass(bare)
    bare_hist = train(bare, 50)
    assert target_mass(bare) > 3 * mass0
    bare_entropy = sum(h["entropy"] for h in bare_hist[-5:]) / 5
    assert bare_entropy < COLLAPSED < ENTROPY_FLOOR < reg_entropy
    assert min(h["distinct_frac"] for h in bare_hist[-5:]) <= min(h["distinct_frac"] for h in hist[-5:])


def _perturbed(events: list[RewardEvent], delta: float) -> list[RewardEvent]:
    return [e.model_copy(update={"logprobs": tuple(x + delta for x in e.logprobs)}) for e in events]


def test_importance_weights_and_clipping_follow_the_maths(tiny_model_dir):
    policy = load(tiny_model_dir, loss="ppo", entropy=0.0, kl=0.0)
    torch.manual_seed(1)
    samples = policy.sample(PROMPTS, max_new_tokens=8)
    events = [e.model_copy(update={"reward": float(i % 2)}) for i, e in enumerate(events_from(samples, 0))]

    on = policy.forward_backward(events)
    assert on["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert on["logprob_gap"] < 1e-3 and on["clip_frac"] == 0.0 and on["tis_frac"] == 0.0

    # behaviour logprobs raised by log 2: every ratio is 1/2. PPO (clip 0.2) clips exactly the
    # tokens whose advantage is negative (ratio < 0.8 and A < 0); positive ones stay unclipped.
    half = policy.forward_backward(_perturbed(events, math.log(2.0)))
    assert half["ratio_mean"] == pytest.approx(0.5, rel=1e-3)
    assert half["logprob_gap"] == pytest.approx(math.log(2.0), rel=1e-3)
    neg_share = sum(len(e.completion_token_ids) for e in events if e.reward == 0) / sum(len(e.completion_token_ids) for e in events)
    assert half["clip_frac"] == pytest.approx(neg_share, abs=1e-6)

    # lowered by log 3: ratio 3 is above the TIS cap (2) and outside the clip for every token
    triple = policy.forward_backward(_perturbed(events, -math.log(3.0)))
    assert triple["ratio_mean"] == pytest.approx(3.0, rel=1e-3)
    assert triple["tis_frac"] == 1.0 and triple["clip_frac"] == 1.0
    policy.engine.zero_grad()
