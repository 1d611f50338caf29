"""Judging a canary and a gate: pure functions from measurements to a verdict with its reasons.

Measuring (release/measure.py, release/gate.py) is separate from judging: everything here is a
function of its arguments, table-tested rule by rule in tests/unit/test_release_judge.py. The
phases follow Argo Rollouts' analysis: a verdict is RUNNING until the evidence says something,
PASS or FAIL when it does, INCONCLUSIVE when the deadline passes first (a person decides), ERROR
when measurements failed too often (never promotes; rolls back like FAIL).

Order of the canary rules, first match wins:

1. measurement errors in a row at or past ``error_limit``: ERROR;
2. once each arm has served ``min_events`` requests, a guardrail breached (error rate, latency,
   output length, share of rejects, reward-guard flags, and the degeneracy of the answers served:
   character repetition, character-class stuffing, length collapse; each canary against stable):
   FAIL, naming it;
3. once each arm has ``min_events`` accepts, rejects or edits (no verdict on a handful of users),
   the always-valid test says the canary is accepted less often: FAIL;
4. ... or more often, at this canary's level (``pass_alpha``: the deployment's budget across
   canaries, release/sequential.py): PASS;
5. past ``deadline_s`` without a verdict, enough traffic or not: INCONCLUSIVE (a person decides);
6. otherwise RUNNING, saying what it waits for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from flywheel.degeneracy import TextProfile, compare
from flywheel.settings import ReleaseSettings
from release.sequential import PairCount, e_value, log_e_better, log_e_worse


class Outcome(StrEnum):
    RUNNING = "running"
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArmStats:
    """What one arm's users did, measured from the event streams (release/measure.py)."""

    outcomes: int = 0  # users' first explicit accept, reject or edit, once reward judged it
    accepts: int = 0
    rejects: int = 0
    requests: int = 0  # generations served
    errors: int = 0  # generations that ended in an error
    latency_ms_p95: float = 0.0
    completion_tokens_mean: float = 0.0
    flagged: int = 0  # rewards the reward guards flagged for hacking (long, repetition)
    rewards: int = 0
    excluded: int = 0  # outcomes dropped: reward's abuse guards flagged their user
    pending: int = 0  # outcomes waiting for reward's judgement
    #: the answers served, for the degeneracy guardrails (flywheel/degeneracy.py)
    text: TextProfile = field(default_factory=TextProfile)

    @property
    def accept_rate(self) -> float:
        return self.accepts / self.outcomes if self.outcomes else 0.0

    @property
    def reject_share(self) -> float:
        """Explicit rejects among every generation served (an ignored answer is no reject)."""
        return self.rejects / self.requests if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def flag_rate(self) -> float:
        return self.flagged / self.rewards if self.rewards else 0.0


@dataclass(frozen=True)
class CanaryMeasurement:
    stable: ArmStats
    canary: ArmStats
    pairs: PairCount
    elapsed_s: float
    measurement_errors: int = 0
    #: users reward's abuse guards flagged, excluded from the comparison (release/measure.py)
    excluded_users: int = 0
    #: ... of whom this many had an outcome counted before the flag came (it stays: pairs are fixed)
    flagged_after_counting: int = 0


@dataclass(frozen=True)
class DegeneracyLimits:
    """How far the candidate's answers may move from stable's (flywheel/degeneracy.py), at the gate
    and on the canary: ``release.max_repetition_increase`` and the two after it."""

    max_repetition_increase: float
    max_char_class_shift: float
    max_collapse_increase: float

    @classmethod
    def of(cls, cfg: ReleaseSettings) -> DegeneracyLimits:
        """The same limits at the gate and on the canary: the canary adds only its allowance for noise."""
        return cls(max_repetition_increase=cfg.max_repetition_increase, max_char_class_shift=cfg.max_char_class_shift,
                   max_collapse_increase=cfg.max_collapse_increase)


@dataclass(frozen=True)
class CanaryPolicy:
    """The limits a canary is judged by: the ``[release]`` settings of the same names (flywheel/
    settings.py documents each, and holds the one default of each). Built by :meth:`of`."""

    alpha: float
    min_events: int
    deadline_s: float
    error_limit: int
    max_error_rate_increase: float
    max_latency_ratio: float
    max_length_ratio: float
    guardrail_z: float
    max_reject_share_increase: float
    max_flag_rate_increase: float
    degeneracy: DegeneracyLimits
    #: The level this canary's PASS is tested at, from the deployment's budget across canaries
    #: (release/sequential.py ``canary_alpha``); None: ``alpha``. FAIL is tested at ``alpha``.
    #: Not a setting: the controller sets it per canary.
    pass_alpha: float | None = None

    @classmethod
    def of(cls, cfg: ReleaseSettings) -> CanaryPolicy:
        return cls(alpha=cfg.alpha, min_events=cfg.min_events, deadline_s=cfg.deadline_s, error_limit=cfg.error_limit,
                   max_error_rate_increase=cfg.max_error_rate_increase, max_latency_ratio=cfg.max_latency_ratio,
                   max_length_ratio=cfg.max_length_ratio, guardrail_z=cfg.guardrail_z,
                   max_reject_share_increase=cfg.max_reject_share_increase,
                   max_flag_rate_increase=cfg.max_flag_rate_increase, degeneracy=DegeneracyLimits.of(cfg))


def judge_canary(m: CanaryMeasurement, policy: CanaryPolicy) -> Verdict:
    """The canary's verdict (module docstring: the rules, in order)."""
    if m.measurement_errors >= policy.error_limit:
        return Verdict(Outcome.ERROR, ((f"{m.measurement_errors} measurements failed in a row "
                                       f"(limit {policy.error_limit})"),))
    # guardrails are judged on what was served, not on what users said: a canary whose answers
    # all fail gets no accepts or rejects, and must still be rolled back
    served = min(m.stable.requests, m.canary.requests) >= policy.min_events
    if served and (breached := guardrails(m.stable, m.canary, policy)):
        return Verdict(Outcome.FAIL, breached)
    short = [name for name, arm in (("stable", m.stable), ("canary", m.canary)) if arm.outcomes < policy.min_events]
    pass_alpha = policy.pass_alpha or policy.alpha
    stats = (f"{m.pairs.wins} discordant pairs won by canary, {m.pairs.losses} by stable; accept rate "
             f"{m.canary.accept_rate:.3f} against {m.stable.accept_rate:.3f}")
    if m.excluded_users:
        stats += (f"; {m.excluded_users} users flagged by reward's guards left out"
                  + (f" ({m.flagged_after_counting} after their outcome counted)" if m.flagged_after_counting else ""))
    if not short and log_e_worse(m.pairs) >= math.log(1 / policy.alpha):
        return Verdict(Outcome.FAIL, ((f"canary accepted less often (e-value {_shown(log_e_worse(m.pairs))} "
                                      f">= {1 / policy.alpha:.0f}): {stats}"),))
    if not short and log_e_better(m.pairs) >= math.log(1 / pass_alpha):
        level = f", this canary's level {pass_alpha:.3g}" if pass_alpha != policy.alpha else ""
        return Verdict(Outcome.PASS, ((f"canary accepted more often (e-value {_shown(log_e_better(m.pairs))} "
                                      f">= {1 / pass_alpha:.0f}{level}): {stats}"),))
    waiting = tuple(f"{name} has {getattr(m, name).outcomes} of the {policy.min_events} outcomes needed "
                    "before a verdict on accept rate" for name in short)
    if m.elapsed_s >= policy.deadline_s:
        # no traffic at all ends here too: a canary nobody uses is held for a person, not kept forever
        return Verdict(Outcome.INCONCLUSIVE, ((f"no verdict after {m.elapsed_s:.0f}s (deadline "
                                              f"{policy.deadline_s:.0f}s): {stats}"), *waiting))
    return Verdict(Outcome.RUNNING, waiting or (stats,))


def _shown(log_e: float) -> str:
    """An e-value for a reason: ``25.0``, or ``3.21e+17`` once it is too long to read in full."""
    e = e_value(log_e)
    return f"{e:.1f}" if e < 1e6 else f"{e:.2e}"


#: Requests each arm needs before its p95 latency is compared: over fewer, two slow requests set it
#: (a canary no slower than stable was rolled back on 45 requests, p95 500 ms against 318 ms).
LATENCY_MIN_REQUESTS = 100


def guardrails(stable: ArmStats, canary: ArmStats, policy: CanaryPolicy) -> tuple[str, ...]:
    """Every guardrail the canary breaches against stable, as reasons (empty: none).

    The float limits are written as "not within" so that a NaN measurement breaches them."""
    out = []
    z = policy.guardrail_z
    if _rate_breached(canary.errors, canary.requests, stable.errors, stable.requests, policy.max_error_rate_increase, z):
        out.append(f"guardrail error rate: {canary.error_rate:.3f} against {stable.error_rate:.3f} "
                   f"(at most +{policy.max_error_rate_increase})")
    latency_judged = min(stable.requests, canary.requests) >= LATENCY_MIN_REQUESTS and stable.latency_ms_p95 > 0
    if latency_judged and not canary.latency_ms_p95 <= policy.max_latency_ratio * stable.latency_ms_p95:
        out.append(f"guardrail latency: p95 {canary.latency_ms_p95:.0f} ms against {stable.latency_ms_p95:.0f} ms "
                   f"(at most x{policy.max_latency_ratio})")
    lo, hi = 1 / policy.max_length_ratio, policy.max_length_ratio
    if stable.completion_tokens_mean > 0 and not lo <= canary.completion_tokens_mean / stable.completion_tokens_mean <= hi:
        out.append(f"guardrail output length: {canary.completion_tokens_mean:.1f} tokens against "
                   f"{stable.completion_tokens_mean:.1f} (within x{policy.max_length_ratio})")
    if _rate_breached(canary.rejects, canary.requests, stable.rejects, stable.requests,
                      policy.max_reject_share_increase, z):
        out.append(f"guardrail share of rejects: {canary.reject_share:.3f} against {stable.reject_share:.3f} "
                   f"(at most +{policy.max_reject_share_increase})")
    if _rate_breached(canary.flagged, canary.rewards, stable.flagged, stable.rewards, policy.max_flag_rate_increase, z):
        out.append(f"guardrail reward-guard flags: {canary.flag_rate:.3f} against {stable.flag_rate:.3f} "
                   f"(at most +{policy.max_flag_rate_increase})")
    out.extend(f"guardrail {r}" for r in degenerate(stable.text, canary.text, policy.degeneracy, z))
    return tuple(out)


def degenerate(stable: TextProfile, candidate: TextProfile, limits: DegeneracyLimits, z: float) -> list[str]:
    """The degeneracy checks the candidate's answers fail against stable's, as reasons: each breaches
    when its move passes its allowance by ``z`` standard errors (0 at the gate: one look at a fixed
    prompt set; ``guardrail_z`` on the canary, looked at every tick). Written as "not within", so
    a NaN breaches."""
    if not stable.answers or not candidate.answers:
        return []
    c = compare(stable, candidate)
    out = []
    rep, cls, short = c.repetition, c.char_class, c.collapsed
    if not rep.increase - limits.max_repetition_increase <= z * rep.se:
        out.append(f"character repetition {rep.candidate:.3f} against {rep.stable:.3f} (share of an answer's "
                   f"character pairs doubled or repeated; at most +{limits.max_repetition_increase})")
    if not abs(cls.increase) - limits.max_char_class_shift <= z * cls.se:
        out.append(f"character-class stuffing: {cls.what} {cls.candidate:.3f} of an answer's characters against "
                   f"{cls.stable:.3f} (within +-{limits.max_char_class_shift})")
    if not short.increase - limits.max_collapse_increase <= z * short.se:
        out.append(f"length collapse: {short.candidate:.0%} of answers under a quarter to a half of stable's "
                   f"median length against {short.stable:.0%} (at most +{limits.max_collapse_increase:.0%})")
    return out


def _rate_breached(c_hits: int, c_n: int, s_hits: int, s_n: int, allowance: float, z: float) -> bool:
    """The canary's rate is above stable's by more than ``allowance``, by ``z`` standard errors
    of the difference (binomial, each arm's own rate): a breach sampling noise does not explain.
    A canary whose every answer fails against a stable that never does has no noise to hide in."""
    c = c_hits / c_n if c_n else 0.0
    s = s_hits / s_n if s_n else 0.0
    se = math.sqrt((c * (1 - c) / c_n if c_n else 0.0) + (s * (1 - s) / s_n if s_n else 0.0))
    return c - s - allowance > z * se


# -- the offline gate ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GateMeasurement:
    """Candidate against stable on the held-out prompts (release/gate.py)."""

    prompts: int
    stable_length_mean: float
    candidate_length_mean: float
    kl_from_stable: float  # mean per token, nats, on the candidate's own samples
    stable_entropy: float  # mean per-token entropy, nats
    candidate_entropy: float
    stable_distinct: float  # share of distinct completions
    candidate_distinct: float
    #: labeler/verifier name -> (stable mean, candidate mean)
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: the trainer's own collapse signals from the checkpoint event
    trainer_metrics: dict[str, float] = field(default_factory=dict)
    #: both versions' answers, for the degeneracy checks (flywheel/degeneracy.py)
    stable_text: TextProfile = field(default_factory=TextProfile)
    candidate_text: TextProfile = field(default_factory=TextProfile)


@dataclass(frozen=True)
class GatePolicy:
    """The limits the offline gate judges by: the ``release.gate_*`` settings (flywheel/settings.py
    holds their one default each) and the degeneracy limits the canary shares. Built by :meth:`of`."""

    max_length_ratio: float
    max_kl: float
    min_entropy_ratio: float
    min_distinct_ratio: float
    max_score_drop: float
    min_trainer_entropy: float
    min_trainer_distinct: float
    degeneracy: DegeneracyLimits

    @classmethod
    def of(cls, cfg: ReleaseSettings) -> GatePolicy:
        return cls(max_length_ratio=cfg.gate_max_length_ratio, max_kl=cfg.gate_max_kl,
                   min_entropy_ratio=cfg.gate_min_entropy_ratio, min_distinct_ratio=cfg.gate_min_distinct_ratio,
                   max_score_drop=cfg.gate_max_score_drop, min_trainer_entropy=cfg.gate_min_trainer_entropy,
                   min_trainer_distinct=cfg.gate_min_trainer_distinct, degeneracy=DegeneracyLimits.of(cfg))


def judge_gate(g: GateMeasurement, policy: GatePolicy) -> Verdict:
    """PASS when no check fails, FAIL naming every failed check. Each check is written as "not
    within its limit", so a NaN measurement (a diverged candidate) fails it instead of passing."""
    failed = []
    if g.prompts == 0:
        return Verdict(Outcome.ERROR, ("the held-out prompt set is empty",))
    if g.stable_length_mean > 0:
        ratio = g.candidate_length_mean / g.stable_length_mean
        if not 1 / policy.max_length_ratio <= ratio <= policy.max_length_ratio:
            failed.append(f"output length drift: {g.candidate_length_mean:.1f} tokens against "
                          f"{g.stable_length_mean:.1f} (within x{policy.max_length_ratio})")
    if not g.kl_from_stable <= policy.max_kl:
        failed.append(f"KL from stable {g.kl_from_stable:.3f} nats/token (at most {policy.max_kl})")
    if not g.candidate_entropy >= policy.min_entropy_ratio * g.stable_entropy:
        failed.append(f"per-token entropy {g.candidate_entropy:.3f} against {g.stable_entropy:.3f} "
                      f"(at least x{policy.min_entropy_ratio})")
    if not g.candidate_distinct >= policy.min_distinct_ratio * g.stable_distinct:
        failed.append(f"distinct completions {g.candidate_distinct:.2f} against {g.stable_distinct:.2f} "
                      f"(at least x{policy.min_distinct_ratio})")
    for name, (stable, candidate) in sorted(g.scores.items()):
        if not stable - candidate <= policy.max_score_drop:
            failed.append(f"{name}: {candidate:.3f} against {stable:.3f} (at most -{policy.max_score_drop})")
    entropy = g.trainer_metrics.get("entropy")
    if entropy is not None and not entropy >= policy.min_trainer_entropy:
        failed.append(f"the trainer reports policy entropy {entropy:.3f} nats (at least {policy.min_trainer_entropy})")
    distinct = g.trainer_metrics.get("distinct_frac")
    if distinct is not None and not distinct >= policy.min_trainer_distinct:
        failed.append(f"the trainer reports {distinct:.2f} distinct completions per batch "
                      f"(at least {policy.min_trainer_distinct})")
    failed.extend(degenerate(g.stable_text, g.candidate_text, policy.degeneracy, 0.0))
    if failed:
        return Verdict(Outcome.FAIL, tuple(failed))
    return Verdict(Outcome.PASS, (f"{g.prompts} held-out prompts: every check within its limit",))
