"""Policy-gradient objectives as pure functions of tensors, selected by name from a registry.

Every loss takes one :class:`LossInputs` (token-aligned tensors for a batch of completions) and a
:class:`LossConfig`, and returns ``(loss, stats)``. Nothing here knows about DeepSpeed, Kafka or
models, so the maths is unit-tested on hand-made tensors (tests/unit/test_trainer_losses.py).

Notation, per completion token t of sample i:

* ``logp``      log pi_theta(y_t) under the trainer (carries the gradient),
* ``old_logp``  log mu(y_t) recorded by the sampler that produced the sample (behaviour policy),
* ``ratio``     exp(logp - old_logp): trainer/behaviour importance ratio. Live feedback is always
  off-policy (the served version lags the trainer, and engines compute slightly different
  logprobs for the same weights), so every objective is corrected by this ratio.
* ``A_i``       the advantage, one per sample (outcome reward, no value model).

Truncated importance sampling (TIS) is on for every objective: the ratio's weight is capped at
``tis_cap`` so one token the sampler found unlikely cannot dominate a step. For the clipped
objectives the cap is the "dual clip" bound on negative advantages (PPO's min() leaves
ratio * A unbounded below when A < 0).

Regularisers, on by default because a bare policy gradient on accept/reject collapses to a few
tokens: an entropy bonus taken as a *per-token mean* (a sum would reward longer answers) and a KL
penalty to a reference policy with the non-negative ``k3`` estimator
``exp(ref - logp) - (ref - logp) - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

EPS = 1e-6
#: Log-ratios are clamped here before exp(). e^20 (5e8) is far past every clip and cap, so no
#: objective's value changes; but a ratio that overflows float32 (a behaviour logprob of -100 on
#: a token the trainer finds likely) is infinite, its gradient 0 x inf = NaN, and one such token
#: made every weight NaN for good.
LOG_RATIO_MAX = 20.0


def ratio_of(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), finite: see :data:`LOG_RATIO_MAX`."""
    return log_ratio.clamp(max=LOG_RATIO_MAX).exp()


@dataclass(frozen=True)
class LossConfig:
    name: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    entropy_coef: float = 0.01
    kl_coef: float = 0.02


@dataclass
class LossInputs:
    """Token-aligned tensors, shape ``[B, T]`` unless noted; ``mask`` is 1 on completion tokens."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor  # [B]
    group_ids: list[str]
    weights: torch.Tensor | None = None  # [B] sample weights from the reward stage's guards
    entropy: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


Stats = dict[str, float]
LossFn = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, Stats]]


# ---------------------------------------------------------------- advantages


def baseline_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean reward as baseline (unbiased, lower variance)."""
    return rewards - rewards.mean()


def group_advantages(rewards: torch.Tensor, group_ids: list[str], normalise: bool = True) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std when ``normalise``.

    A group of one sample (or of equal rewards) gets advantage 0: it carries no signal about
    which completion was better, which is why active sampling keeps such groups out of batches.
    """
    out = torch.zeros_like(rewards)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid], device=rewards.device)
        r = rewards[idx]
        centred = r - r.mean()
        if normalise and len(idx) > 1:
            centred = centred / (r.std(unbiased=False) + EPS)
        out[idx] = centred
    return out


# ---------------------------------------------------------------- reductions


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every completion token of the batch (DAPO's token-level normalisation)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over its tokens, shape ``[B]``."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


# ---------------------------------------------------------------- objectives


def _weighted(adv: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    return adv * inp.weights if inp.weights is not None else adv


def _ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> Stats:
    ratio = ratio_of(log_ratio.detach())
    m = mask.bool()
    r = ratio[m] if m.any() else torch.ones(1)
    return {
        "ratio_mean": float(r.mean()),
        "ratio_max": float(r.max()),
        "ratio_min": float(r.min()),
        "tis_frac": float((r > cfg.tis_cap).float().mean()),
        "logprob_gap": float(log_ratio.detach().abs()[m].mean()) if m.any() else 0.0,
    }


def _reinforce_like(inp: LossInputs, cfg: LossConfig, adv: torch.Tensor) -> tuple[torch.Tensor, Stats]:
    """-w * A * logp with w = min(ratio, cap), detached: the truncated-IS policy gradient."""
    log_ratio = inp.logp - inp.old_logp
    w = ratio_of(log_ratio.detach()).clamp(max=cfg.tis_cap)
    pg = -(w * adv[:, None] * inp.logp)
    stats = _ratio_stats(log_ratio, inp.mask, cfg)
    stats["clip_frac"] = stats["tis_frac"]
    return token_mean(pg, inp.mask), stats


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, lo: float, hi: float, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO surrogate with dual clip: returns (per-element objective to maximise, clipped mask)."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - lo, 1.0 + hi) * adv
    obj = torch.minimum(unclipped, clipped)
    # dual clip: with A < 0, min() would let ratio * A fall without bound; cap it at cap * A
    obj = torch.where(adv < 0, torch.maximum(obj, cap * adv), obj)
    was_clipped = (clipped < unclipped) | ((adv < 0) & (ratio > cap))
    return obj, was_clipped


def reinforce(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Stats]:
    adv = _weighted(baseline_advantages(inp.rewards), inp)
    return _reinforce_like(inp, cfg, adv)


def _ppo_family(inp: LossInputs, cfg: LossConfig, adv: torch.Tensor, hi: float, per_token: bool) -> tuple[torch.Tensor, Stats]:
    log_ratio = inp.logp - inp.old_logp
    obj, was_clipped = _clipped(ratio_of(log_ratio), adv[:, None], cfg.clip_low, hi, cfg.tis_cap)
    loss = -(token_mean(obj, inp.mask) if per_token else seq_mean(obj, inp.mask).mean())
    stats = _ratio_stats(log_ratio, inp.mask, cfg)
    stats["clip_frac"] = float(token_mean(was_clipped.float(), inp.mask))
    return loss, stats


def ppo(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Stats]:
    """Symmetric clip (``clip_low`` both ways) against the behaviour logprobs, batch baseline."""
    adv = _weighted(baseline_advantages(inp.rewards), inp)
    return _ppo_family(inp, cfg, adv, cfg.clip_low, per_token=True)


def grpo(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Stats]:
    """Group-normalised advantages, symmetric clip, mean per sequence then over the batch."""
    adv = _weighted(group_advantages(inp.rewards, inp.group_ids), inp)
    return _ppo_family(inp, cfg, adv, cfg.clip_low, per_token=False)


def dapo(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Stats]:
    """Asymmetric clip (``clip_high`` > ``clip_low`` lets unlikely good tokens grow), token mean."""
    adv = _weighted(group_advantages(inp.rewards, inp.group_ids), inp)
    return _ppo_family(inp, cfg, adv, cfg.clip_high, per_token=True)


def gspo(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Stats]:
    """Sequence-level ratio exp(mean_t log ratio): one clip decision per completion."""
    adv = _weighted(group_advantages(inp.rewards, inp.group_ids), inp)
    log_ratio = inp.logp - inp.old_logp
    seq_ratio = ratio_of(seq_mean(log_ratio, inp.mask))
    obj, was_clipped = _clipped(seq_ratio, adv, cfg.clip_low, cfg.clip_high, cfg.tis_cap)
    stats = _ratio_stats(log_ratio, inp.mask, cfg)
    stats["clip_frac"] = float(was_clipped.float().mean())
    stats["seq_ratio_mean"] = float(seq_ratio.detach().mean())
    return -obj.mean(), stats


LOSSES: dict[str, LossFn] = {
    "reinforce": reinforce,
    "ppo": ppo,
    "grpo": grpo,
    "gspo": gspo,
    "dapo": dapo,
}
GROUPED = frozenset({"grpo", "gspo", "dapo"})


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate on samples from pi; >= 0, exact in expectation."""
    d = ref_logp - logp
    return d.exp() - d - 1.0


def total_loss(inp: LossInputs, cfg: LossConfig, fn: LossFn | None = None) -> tuple[torch.Tensor, Stats]:
    """The selected objective plus the regularisers; ``fn`` overrides the registry (custom losses)."""
    fn = fn or LOSSES[cfg.name]
    loss, stats = fn(inp, cfg)
    stats["pg_loss"] = float(loss.detach())
    if inp.entropy is not None:
        ent = token_mean(inp.entropy, inp.mask)
        stats["entropy"] = float(ent.detach())
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    if inp.ref_logp is not None:
        kl = token_mean(kl_k3(inp.logp, inp.ref_logp), inp.mask)
        stats["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    stats["loss"] = float(loss.detach())
    return loss, stats
