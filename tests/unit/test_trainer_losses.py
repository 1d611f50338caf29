"""The objectives' maths on hand-made tensors: advantages, ratios, clipping, TIS, regularisers."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.losses import (
    LOSSES,
    LossConfig,
    LossInputs,
    baseline_advantages,
    group_advantages,
    kl_k3,
    token_mean,
    total_loss,
)


def inputs(logp, old, rewards, groups=None, mask=None, **kw) -> LossInputs:
    logp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float32)
    return LossInputs(
        logp=logp, old_logp=old, mask=torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32), group_ids=groups or [f"g{i}" for i in range(len(rewards))], **kw,
    )


def test_baseline_and_group_advantages():
    assert baseline_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0])).tolist() == [0.5, -0.5, -0.5, 0.5]
    adv = group_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0]), ["a", "a", "b", "b"])
    assert adv[0] > 0 > adv[1]
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2:].tolist() == [0.0, 0.0]  # equal rewards: no signal, zero advantage


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_gradient_raises_logp_of_rewarded_sample(name):
    """On-policy (ratio 1), every objective pushes the good sample's logp up, the bad one's down."""
    inp = inputs([[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0], [-1.0, -1.0]], [1.0, 0.0], groups=["a", "a"])
    loss, stats = LOSSES[name](inp, LossConfig(name=name))
    loss.backward()
    g = inp.logp.grad
    assert (g[0] < 0).all() and (g[1] > 0).all()  # descent raises row 0, lowers row 1
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0


@pytest.mark.parametrize(
    "log_ratio, adv_sign, clipped",
    [
        (math.log(1.5), +1, True),   # good sample already much likelier: clipped above 1 + eps
        (math.log(1.1), +1, False),  # inside the trust region
        (math.log(0.5), -1, True),   # bad sample already much less likely: clipped below 1 - eps
        (math.log(0.5), +1, False),  # good sample made less likely: never clipped (pessimistic min)
        (math.log(3.0), -1, True),   # dual clip / TIS cap 2: bad sample with a huge ratio
    ],
)
def test_ppo_clip_table(log_ratio, adv_sign, clipped):
    rewards = [1.0, 0.0] if adv_sign > 0 else [0.0, 1.0]
    inp = inputs([[log_ratio - 1.0], [-1.0]], [[-1.0], [-1.0]], rewards)
    loss, stats = LOSSES["ppo"](inp, LossConfig(name="ppo", clip_low=0.2, tis_cap=2.0))
    loss.backward()
    assert (stats["clip_frac"] > 0) == clipped
    assert (inp.logp.grad[0, 0] == 0) == clipped  # a clipped token contributes no gradient


def test_dapo_clips_asymmetrically():
    cfg = LossConfig(name="dapo", clip_low=0.2, clip_high=0.28)
    up = inputs([[math.log(1.25) - 1], [-1.0]], [[-1.0], [-1.0]], [1.0, 0.0], groups=["a", "a"])
    assert LOSSES["dapo"](up, cfg)[1]["clip_frac"] == 0.0  # 1.25 < 1.28: DAPO still learns
    assert LOSSES["ppo"](up, LossConfig(name="ppo", clip_low=0.2))[1]["clip_frac"] > 0  # PPO clips at 1.2


def test_gspo_uses_the_sequence_ratio():
    # token log-ratios +0.5 and -0.5 average to 0: sequence ratio 1, so GSPO clips nothing
    inp = inputs([[-0.5, -1.5], [-1.0, -1.0]], [[-1.0, -1.0], [-1.0, -1.0]], [1.0, 0.0], groups=["a", "a"])
    _, stats = LOSSES["gspo"](inp, LossConfig(name="gspo"))
    assert stats["seq_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["clip_frac"] == 0.0
    _, tok = LOSSES["grpo"](inp, LossConfig(name="grpo"))
    assert tok["clip_frac"] > 0  # the per-token objective clips the +0.5 token


def test_reinforce_truncated_importance_weight():
    """REINFORCE weights each token by min(ratio, cap): ratio 4 with cap 2 gives twice the on-policy gradient."""
    on = inputs([[-1.0], [-1.0]], [[-1.0], [-1.0]], [1.0, 0.0])
    off = inputs([[-1.0], [-1.0]], [[-1.0 - math.log(4.0)], [-1.0]], [1.0, 0.0])
    cfg = LossConfig(name="reinforce", tis_cap=2.0)
    LOSSES["reinforce"](on, cfg)[0].backward()
    _, stats = LOSSES["reinforce"](off, cfg)
    LOSSES["reinforce"](off, cfg)[0].backward()
    assert off.logp.grad[0, 0] == pytest.approx(2.0 * on.logp.grad[0, 0])
    assert stats["tis_frac"] == 0.5 and stats["ratio_max"] == pytest.approx(4.0)
    assert stats["logprob_gap"] == pytest.approx(math.log(4.0) / 2)


def test_entropy_bonus_is_a_per_token_mean():
    """Padding a sequence with more tokens of the same entropy must not change the bonus."""
    short = inputs([[-1.0, 0.0]], [[-1.0, 0.0]], [1.0], mask=[[1.0, 0.0]], entropy=torch.tensor([[2.0, 2.0]]))
    long = inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [1.0], mask=[[1.0, 1.0]], entropy=torch.tensor([[2.0, 2.0]]))
    cfg = LossConfig(name="reinforce", entropy_coef=0.1, kl_coef=0.0)
    assert total_loss(short, cfg)[1]["entropy"] == total_loss(long, cfg)[1]["entropy"] == 2.0


def test_kl_k3_is_nonnegative_and_zero_at_reference():
    logp = torch.tensor([-1.0, -2.0, -0.1])
    assert kl_k3(logp, logp).abs().max() == 0
    assert (kl_k3(logp, logp + torch.tensor([0.3, -0.7, 1.0])) > 0).all()


def test_kl_penalty_pulls_towards_reference():
    inp = inputs([[-1.0]], [[-1.0]], [0.0], ref_logp=torch.tensor([[-2.0]]))
    loss, stats = total_loss(inp, LossConfig(name="reinforce", kl_coef=1.0, entropy_coef=0.0))
    loss.backward()
    assert stats["kl"] > 0
    assert inp.logp.grad[0, 0] > 0  # descent lowers logp towards the reference's -2


def test_token_mean_ignores_padding():
    assert float(token_mean(torch.tensor([[1.0, 100.0]]), torch.tensor([[1.0, 0.0]]))) == 1.0


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("old", [-100.0, -1e4])
def test_a_huge_ratio_gives_the_clipped_loss_and_finite_gradients(name, old):
    """exp(-0.5 - old) overflows float32: unclamped, the loss's gradient was NaN (0 x inf) and one
    such token made every weight NaN. The value is what a clip at any ratio past the cap gives."""
    def loss_and_grad(old_logp):
        inp = inputs([[-0.5, -1.0], [-1.0, -1.0]], [[old_logp, -1.0], [-1.0, -1.0]], [0.0, 1.0], groups=["a", "a"])
        loss, stats = LOSSES[name](inp, LossConfig(name=name))
        loss.backward()
        return loss, inp.logp.grad, stats

    loss, grad, stats = loss_and_grad(old)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    moderate, moderate_grad, _ = loss_and_grad(-10.0)  # a ratio of e^9.5: past every clip already
    assert float(loss.detach()) == pytest.approx(float(moderate.detach()), rel=1e-5)
    assert torch.allclose(grad, moderate_grad)
