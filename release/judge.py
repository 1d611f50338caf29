"""Judging a canary and a gate: pure functions from measurements to a verdict with its reasons.

Measuring (release/measure.py, release/gate.py) is separate from judging: everything here is a
function of its arguments, table-tested rule by rule in tests/unit/test_release_judge.py. The
phases follow Argo Rollouts' analysis: a verdict is RUNNING until the evidence says something,
PASS or FAIL when it does, INCONCLUSIVE when the deadline passes first (a person decides), ERROR
when measurements failed too often (never promotes; rolls back like FAIL).

Order of the canary rules, first match wins:

1. measurement errors in a row at or past ``error_limit``: ERROR;
2. once each arm has served ``min_events`` requests, a guardrail breached at a guardrail look
   (release/budget.py: the p95 latency, the mean output length, the error rate, share of rejects
   and reward-guard flags per user, and the degeneracy of the answers served: character
   repetition, character-class stuffing, length collapse; each canary against stable): FAIL,
   naming it;
3. the arms' users are not the split the routing asked for (the sample-ratio e-process past
   ``1 / srm_alpha``): HOLD, naming the counts. Neither PASS nor FAIL on the accept rate: what
   the arms compare is then not two versions on one population (a share changed mid-canary,
   routing applied to part of the traffic, users who can pick their arm), so a person looks.
   Counted: the users whose arm was chosen after the canary's first generation (release/measure.py
   ``routed_users``), not those served before the routing was in force;
4. once each arm has ``min_events`` accepts, rejects or edits (no verdict on a handful of users),
   the always-valid test says the canary is accepted less often: FAIL;
5. ... or more often, at this canary's level (``pass_alpha``: the deployment's budget across
   canaries, release/budget.py): PASS;
6. past ``deadline_s`` without a verdict, enough traffic or not: INCONCLUSIVE (a person decides);
7. otherwise RUNNING, saying what it waits for.

**Why per user.** Users, not requests, are what serving's hash assigns to an arm, and one user's
requests are alike: judged per request, a few heavy users decide a share of rejects, and
identical versions were rolled back in 19 of 400 canaries (0.867 against 0.440) by a z-test asked
every tick. Each user is one unit: their own error rate, share of rejects and share of flagged
rewards, compared as means over users with Welch's t at the look's level (release/budget.py), so
identical versions are rolled back by these three at most ``guardrail_alpha`` of the time.
Latency and output length are per user as well (the p95 of users' mean latencies, the mean of
their mean lengths), at the same looks, against fixed ratios. The
degeneracy checks stay per answer (an answer's text is the version's, summed in fixed-size
profiles per arm), at the same looks and levels: what a user asks shapes the answers' characters,
so a heavy user can move them, which their allowances (a few points) absorb; they are held
exactly at the gate, on held-out prompts no user chooses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from statistics import NormalDist

from flywheel.degeneracy import TextProfile, compare
from flywheel.degeneracy import se_of_mean as _se
from flywheel.settings import ReleaseSettings
from release.budget import guardrail_level, look_due
from release.meaning import MIN_RELATED_WORDS, TAIL_CHARS, MeaningProfile, share_se
from release.sequential import PairCount, e_value, log_e_better, log_e_worse


class Outcome(StrEnum):
    RUNNING = "running"
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"
    #: the evidence is not a comparison of two versions (a sample-ratio mismatch): held for a person
    HOLD = "hold"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class PerUser:
    """Sums over one arm's users of each user's own rates (release/measure.py keeps a user's
    counts): enough for the mean over users and its variance, so the guardrails count each user
    once whatever they sent (module docstring)."""

    users: int = 0  # users served in this arm since the canary started
    error_sum: float = 0.0  # sum over users of their share of generations that ended in an error
    error_sq: float = 0.0  # ... of its square
    reject_sum: float = 0.0  # sum over users of their share of generations they rejected
    reject_sq: float = 0.0
    raters: int = 0  # users with at least one reward judged
    flag_sum: float = 0.0  # sum over those of their share of rewards flagged for hacking
    flag_sq: float = 0.0
    length_users: int = 0  # users whose output length and latency are known
    length_sum: float = 0.0  # sum over those of their mean output length (tokens)
    latency_p95: float = 0.0  # the 95th percentile over those of their mean latency (ms)


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
    #: ... and what they say to their prompts (release/meaning.py)
    meaning: MeaningProfile = field(default_factory=MeaningProfile)
    #: each user's rates, for the per-user guardrails
    per_user: PerUser = field(default_factory=PerUser)

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
    #: the guardrail look to take now (release/budget.py ``look_due``; 0: none is due this tick)
    look: int = 0
    #: the canary share the routing asked for when the canary started; None: no ratio is judged
    canary_share: float | None = None
    #: (canary, stable) users whose arm was chosen under the canary's routing, the sample-ratio
    #: check's units (release/measure.py ``routed_users``); None: each arm's ``per_user.users``
    routed_users: tuple[int, int] | None = None


@dataclass(frozen=True)
class DegeneracyLimits:
    """How far the candidate's answers may move from stable's (flywheel/degeneracy.py), at the gate
    and on the canary: ``release.max_repetition_increase`` and the two after it."""

    max_repetition_increase: float
    max_char_class_shift: float
    max_collapse_increase: float

    max_leading_share_increase: float
    max_shared_affix_increase: float
    max_unrelated_increase: float
    #: the canary's least share of distinct answers against stable's; None at the gate, which
    #: compares distinct completions itself (``gate_min_distinct_ratio``)
    min_distinct_ratio: float | None = None

    @classmethod
    def of(cls, cfg: ReleaseSettings, *, canary: bool = False) -> DegeneracyLimits:
        """The same limits at the gate and on the canary: the canary adds only its allowance for noise."""
        return cls(max_repetition_increase=cfg.max_repetition_increase, max_char_class_shift=cfg.max_char_class_shift,
                   max_collapse_increase=cfg.max_collapse_increase,
                   max_leading_share_increase=cfg.max_leading_share_increase,
                   max_shared_affix_increase=cfg.max_shared_affix_increase,
                   max_unrelated_increase=cfg.max_unrelated_increase,
                   min_distinct_ratio=cfg.min_distinct_ratio if canary else None)


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
    guardrail_alpha: float
    srm_alpha: float
    max_reject_share_increase: float
    max_flag_rate_increase: float
    degeneracy: DegeneracyLimits
    #: The level this canary's PASS is tested at, from the deployment's budget across canaries
    #: (release/budget.py ``pass_level``); None: ``alpha``. FAIL is tested at ``alpha``.
    #: Not a setting: the controller sets it per canary.
    pass_alpha: float | None = None

    @classmethod
    def of(cls, cfg: ReleaseSettings) -> CanaryPolicy:
        return cls(alpha=cfg.alpha, min_events=cfg.min_events, deadline_s=cfg.deadline_s, error_limit=cfg.error_limit,
                   max_error_rate_increase=cfg.max_error_rate_increase, max_latency_ratio=cfg.max_latency_ratio,
                   max_length_ratio=cfg.max_length_ratio, guardrail_alpha=cfg.guardrail_alpha,
                   srm_alpha=cfg.srm_alpha,
                   max_reject_share_increase=cfg.max_reject_share_increase,
                   max_flag_rate_increase=cfg.max_flag_rate_increase,
                   degeneracy=DegeneracyLimits.of(cfg, canary=True))


def judge_canary(m: CanaryMeasurement, policy: CanaryPolicy) -> Verdict:
    """The canary's verdict (module docstring: the rules, in order)."""
    if m.measurement_errors >= policy.error_limit:
        return Verdict(Outcome.ERROR, ((f"{m.measurement_errors} measurements failed in a row "
                                       f"(limit {policy.error_limit})"),))
    # guardrails are judged on what was served, not on what users said: a canary whose answers
    # all fail gets no accepts or rejects, and must still be rolled back
    served = min(m.stable.requests, m.canary.requests) >= policy.min_events
    if served and (breached := guardrails(m.stable, m.canary, policy, m.look)):
        return Verdict(Outcome.FAIL, breached)
    if mismatch := sample_ratio_mismatch(m, policy.srm_alpha):
        return Verdict(Outcome.HOLD, (mismatch,))
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


def judge_tick(m: CanaryMeasurement, policy: CanaryPolicy, looks_taken: int) -> tuple[Verdict, int]:
    """One tick of the controller: the guardrail look due now, if any, taken once each arm has its
    users and has served ``min_events`` requests (release/budget.py ``look_due``), and the verdict
    with it. Returns the verdict and the looks taken after it, which the caller keeps (the tally
    saves them). Judged on every tick instead, a per-user test would spend its level again and
    again. ``m.look`` is ignored: this decides it."""
    served = min(m.stable.requests, m.canary.requests) >= policy.min_events
    users = min(m.stable.per_user.users, m.canary.per_user.users)
    look = look_due(users, looks_taken) if served else 0
    return judge_canary(replace(m, look=look), policy), max(looks_taken, look)


def _shown(log_e: float) -> str:
    """An e-value for a reason: ``25.0``, or ``3.21e+17`` once it is too long to read in full."""
    e = e_value(log_e)
    return f"{e:.1f}" if e < 1e6 else f"{e:.2e}"


#: Users each arm needs before the p95 of their mean latencies is compared: over fewer, one or two
#: slow users set it (per request, a canary no slower than stable was rolled back on 45 requests,
#: p95 500 ms against 318 ms).
LATENCY_MIN_USERS = 40


#: The checks the guardrails' budget at a look is split over (release/budget.py
#: ``guardrail_level``): error rate, share of rejects, reward-guard flags, the three degeneracy
#: checks and the six on what answers say (:func:`unmeaning`).
GUARDRAIL_CHECKS = 12


def guardrails(stable: ArmStats, canary: ArmStats, policy: CanaryPolicy, look: int = 0) -> tuple[str, ...]:
    """Every guardrail the canary breaches against stable, as reasons (empty: none), judged only
    on a guardrail look (``look`` from 1; 0: none due, module docstring). Latency and output
    length are fixed-ratio limits on noisy estimates: judged every turn (3,600 an hour), they
    rolled back a canary the first time noise crossed the ratio; at the looks, a handful of times
    a canary.

    The float limits are written as "not within" so that a NaN measurement breaches them."""
    out: list[str] = []
    if look < 1:
        return ()
    s, c = stable.per_user, canary.per_user
    # per user, as the rates below: each user's mean latency and output length, so a heavy user
    # with long prompts or long answers counts once, not once per request
    latency_judged = min(s.length_users, c.length_users) >= LATENCY_MIN_USERS and s.latency_p95 > 0
    if latency_judged and not c.latency_p95 <= policy.max_latency_ratio * s.latency_p95:
        out.append(f"guardrail latency: p95 {c.latency_p95:.0f} ms against {s.latency_p95:.0f} ms over "
                   f"{c.length_users} and {s.length_users} users' means (at most x{policy.max_latency_ratio})")
    lo, hi = 1 / policy.max_length_ratio, policy.max_length_ratio
    s_len = s.length_sum / s.length_users if s.length_users else 0.0
    c_len = c.length_sum / c.length_users if c.length_users else 0.0
    if s_len > 0 and c.length_users and not lo <= c_len / s_len <= hi:
        out.append(f"guardrail output length: {c_len:.1f} tokens against {s_len:.1f}, mean over "
                   f"{c.length_users} and {s.length_users} users (within x{policy.max_length_ratio})")
    level = guardrail_level(policy.guardrail_alpha, look, GUARDRAIL_CHECKS)
    at = f"look {look}, level {level:.2g}"
    for name, allowance, cs, ss in (
            ("error rate", policy.max_error_rate_increase, (c.users, c.error_sum, c.error_sq),
             (s.users, s.error_sum, s.error_sq)),
            ("share of rejects", policy.max_reject_share_increase, (c.users, c.reject_sum, c.reject_sq),
             (s.users, s.reject_sum, s.reject_sq)),
            ("reward-guard flags", policy.max_flag_rate_increase, (c.raters, c.flag_sum, c.flag_sq),
             (s.raters, s.flag_sum, s.flag_sq))):
        breach = per_user_breach(cs, ss, allowance, level)
        if breach is not None:
            out.append(f"guardrail {name}: {breach[0]:.3f} against {breach[1]:.3f}, mean over {cs[0]} and "
                       f"{ss[0]} users (at most +{allowance}; {at})")
    z = NormalDist().inv_cdf(1 - level)
    out.extend(f"guardrail {r} ({at})" for r in degenerate(stable.text, canary.text, policy.degeneracy, z))
    out.extend(f"guardrail {r} ({at})" for r in unmeaning(stable.meaning, canary.meaning, policy.degeneracy, z))
    return tuple(out)


def per_user_breach(canary: tuple[int, float, float], stable: tuple[int, float, float], allowance: float,
                    level: float) -> tuple[float, float] | None:
    """The two arms' means over users, when the canary's passes stable's by more than ``allowance``
    beyond what chance explains at one-sided ``level`` (Welch's t on per-user rates; each arm is
    ``(users, sum of their rates, sum of squares)``); None when it does not, or either arm has
    fewer than 2 users. Written as "not within", so a NaN breaches; a canary whose every user
    fails against a stable none of whose users does has no noise to hide in."""
    (nc, sc, qc), (ns, ss, qs) = canary, stable
    if nc < 2 or ns < 2:
        return None
    mc, ms = sc / nc, ss / ns
    vc, vs = max(qc - nc * mc * mc, 0.0) / (nc - 1) / nc, max(qs - ns * ms * ms, 0.0) / (ns - 1) / ns
    se = math.sqrt(vc + vs)
    # Welch-Satterthwaite degrees of freedom (a tiny floor keeps 0/0 out when both are exact)
    df = (vc + vs) ** 2 / (vc * vc / (nc - 1) + vs * vs / (ns - 1)) if vc + vs > 0 else float(nc + ns - 2)
    return None if mc - ms - allowance <= t_quantile(1 - level, df) * se else (mc, ms)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile, from the normal's by the Cornish-Fisher expansion (Abramowitz and
    Stegun 26.7.5): within 1% of the exact quantile for 4 or more degrees of freedom at the levels
    used here, and the normal's for large ``df`` (no scipy in the controller)."""
    z = NormalDist().inv_cdf(p)
    n = max(df, 1.0)
    return (z + (z ** 3 + z) / (4 * n) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * n ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * n ** 3))


#: Log-odds offsets from the routing's share that the sample-ratio e-process weighs equally, both
#: ways: a share of 0.10 against 0.091-0.19 (0.5 against 0.45-0.69), so a routing a few points off
#: is found in thousands of users and a gross one (a share change, routing not applied) in tens.
SRM_OFFSETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)


def log_e_sample_ratio(canary_users: int, stable_users: int, share: float) -> float:
    """log of an e-value against "each new user lands on the canary with probability ``share``".

    Serving's salted hash puts each user on the canary with probability ``share``, whatever the
    order users come in, so the arms' user counts are Bernoulli trials; the e-value mixes the
    likelihood ratios of shares at :data:`SRM_OFFSETS` from it in log-odds, either way: a
    nonnegative martingale under the routing asked for, valid at every tick (Ville)."""
    logit = math.log(share / (1 - share))
    terms = []
    for d in SRM_OFFSETS:
        for q in (1 / (1 + math.exp(-(logit + d))), 1 / (1 + math.exp(-(logit - d)))):
            terms.append(canary_users * math.log(q / share) + stable_users * math.log((1 - q) / (1 - share)))
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms) / len(terms))


def sample_ratio_users(m: CanaryMeasurement) -> tuple[int, int]:
    """(canary, stable) users the sample-ratio check counts."""
    return m.routed_users if m.routed_users is not None else (m.canary.per_user.users, m.stable.per_user.users)


def sample_ratio_mismatch(m: CanaryMeasurement, srm_alpha: float) -> str | None:
    """The reason to hold the canary when its arms' users are not the split the routing asked for
    (None: they are, as far as the evidence says; or no share is known)."""
    share = m.canary_share
    if share is None or not 0 < share < 1:
        return None
    nc, ns = sample_ratio_users(m)
    log_e = log_e_sample_ratio(nc, ns, share)
    if log_e < math.log(1 / srm_alpha):
        return None
    return (f"sample ratio mismatch: {nc} users on the canary and {ns} on stable, {nc / (nc + ns):.3f} where the "
            f"routing asked for {share:.3f} (e-value {_shown(log_e)} >= {1 / srm_alpha:.0f}): the arms are not "
            "the split serving's hash makes, so the comparison is not of versions; held for a person")


def degenerate(stable: TextProfile, candidate: TextProfile, limits: DegeneracyLimits, z: float) -> list[str]:
    """The degeneracy checks the candidate's answers fail against stable's, as reasons: each breaches
    when its move passes its allowance by ``z`` standard errors (0 at the gate: one look at a fixed
    prompt set; on the canary the normal quantile of a guardrail look's level, release/budget.py).
    Written as "not within", so a NaN breaches."""
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


def unmeaning(stable: MeaningProfile, candidate: MeaningProfile, limits: DegeneracyLimits, z: float) -> list[str]:
    """The checks on what the candidate's answers say (release/meaning.py) it fails against
    stable's, as reasons; each breaches when its move passes its allowance by ``z`` standard errors,
    as :func:`degenerate`'s. Written as "not within", so a NaN breaches."""
    if not stable.answers or not candidate.answers:
        return []
    out = []
    (s_word, s_lead), (c_word, c_lead) = stable.leading.top(), candidate.leading.top()
    se = math.hypot(share_se(s_lead, stable.answers), share_se(c_lead, candidate.answers))
    if not c_lead - s_lead - limits.max_leading_share_increase <= z * se:
        out.append(f"same leading answer: {c_lead:.0%} of answers open with {c_word!r} against {s_lead:.0%} with "
                   f"{s_word!r} (at most +{limits.max_leading_share_increase:.0%})")
    (s_affix, s_sh), (c_affix, c_sh) = stable.affix(), candidate.affix()
    se = math.hypot(share_se(s_sh, stable.affixed), share_se(c_sh, candidate.affixed))
    if stable.affixed and candidate.affixed and not c_sh - s_sh - limits.max_shared_affix_increase <= z * se:
        out.append(f"shared prefix or suffix: {c_sh:.0%} of answers share {c_affix!r} against {s_sh:.0%} sharing "
                   f"{s_affix!r} (at most +{limits.max_shared_affix_increase:.0%})")
    s_un, c_un = stable.unrelated_share, candidate.unrelated_share
    if stable.judged and candidate.judged:
        se = math.hypot(share_se(s_un, stable.judged), share_se(c_un, candidate.judged))
        if not c_un - s_un - limits.max_unrelated_increase <= z * se:
            out.append(f"answers unrelated to their prompt: {c_un:.0%} of answers of {MIN_RELATED_WORDS} words or "
                       f"more share no content word with it against {s_un:.0%} "
                       f"(at most +{limits.max_unrelated_increase:.0%})")
    se = math.hypot(_se(stable.repetition_sum, stable.repetition_sq, stable.answers),
                    _se(candidate.repetition_sum, candidate.repetition_sq, candidate.answers))
    if not candidate.repetition - stable.repetition - limits.max_repetition_increase <= z * se:
        out.append(f"repetition anywhere in the answer: {candidate.repetition:.3f} against {stable.repetition:.3f} "
                   f"(its most repetitive 64 characters; at most +{limits.max_repetition_increase})")
    tails = compare(stable.tails, candidate.tails).char_class
    if stable.tails.answers and candidate.tails.answers and \
            not abs(tails.increase) - limits.max_char_class_shift <= z * tails.se:
        out.append(f"appended filler: {tails.what} {tails.candidate:.3f} of an answer's last {TAIL_CHARS} characters "
                   f"against {tails.stable:.3f} (within +-{limits.max_char_class_shift})")
    # over as many answers each: the first of a sample are the most likely to be new
    first = min(stable.sampled, candidate.sampled)
    if limits.min_distinct_ratio is not None and first:
        s_d, c_d = stable.distinct_share(first), candidate.distinct_share(first)
        se = math.hypot(limits.min_distinct_ratio * share_se(s_d, first), share_se(c_d, first))
        if not c_d - limits.min_distinct_ratio * s_d >= -z * se:
            out.append(f"distinct answers: {c_d:.0%} of the canary's first {first} answers are distinct against "
                       f"{s_d:.0%} of stable's first {first} (at least x{limits.min_distinct_ratio})")
    return out


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
    #: ... and what they say (release/meaning.py)
    stable_meaning: MeaningProfile = field(default_factory=MeaningProfile)
    candidate_meaning: MeaningProfile = field(default_factory=MeaningProfile)
    #: each held-out eval scored each way (release/evals.py)
    evals: tuple[EvalScore, ...] = ()


@dataclass(frozen=True)
class EvalScore:
    """One held-out eval scored one way, stable and candidate on the same items (release/evals.py):
    each item scores 1 answered right, 0 answered wrong, 0.5 not answered (a greedy answer that is
    neither: chance, as a version that answers "No" to everything scores on the yes/no questions)."""

    name: str
    method: str  # "likelihood" or "greedy"
    items: int
    stable_right: int
    stable_wrong: int
    candidate_right: int
    candidate_wrong: int
    #: sum over items of the candidate's score less stable's, and of its square
    diff_sum: float
    diff_sq: float

    @property
    def stable_score(self) -> float:
        return (self.stable_right + (self.items - self.stable_right - self.stable_wrong) / 2) / self.items \
            if self.items else math.nan

    @property
    def candidate_score(self) -> float:
        return (self.candidate_right + (self.items - self.candidate_right - self.candidate_wrong) / 2) / self.items \
            if self.items else math.nan

    @classmethod
    def of(cls, name: str, method: str, stable: list[bool | None], candidate: list[bool | None]) -> EvalScore:
        """From each item's right (True), wrong (False) or not answered (None), in the same order
        for both versions."""
        def score(x: bool | None) -> float:
            return 0.5 if x is None else float(x)
        diffs = [score(c) - score(s) for s, c in zip(stable, candidate, strict=True)]
        return cls(name, method, len(stable), sum(x is True for x in stable), sum(x is False for x in stable),
                   sum(x is True for x in candidate), sum(x is False for x in candidate),
                   sum(diffs), sum(d * d for d in diffs))


def non_inferiority(score: EvalScore, level: float) -> tuple[float, float]:
    """The candidate's mean score less stable's, and its one-sided lower confidence bound at
    ``level``: Wald's on the paired differences (only the items the two versions score apart move
    it), less 1/n as a continuity correction, so a small regression set does not pass on luck."""
    n = score.items
    if not n:
        return 0.0, -math.inf
    d = score.diff_sum / n
    se = math.sqrt(max(score.diff_sq / n - d * d, 0.0) / n)
    return d, d - NormalDist().inv_cdf(1 - level) * se - 1 / n


def judge_evals(scores: tuple[EvalScore, ...], margin: float, alpha: float) -> tuple[list[str], list[str]]:
    """(failed, passed) reasons of the held-out evals: an eval scored one way fails when its lower
    bound (:func:`non_inferiority`) is below ``-margin``, the candidate not shown within the margin
    of stable; ``alpha`` is split over every eval and way (Bonferroni)."""
    failed, passed = [], []
    level = alpha / max(len(scores), 1)
    for s in scores:
        d, lower = non_inferiority(s, level)
        line = (f"held-out eval {s.name} ({s.method}): score {s.candidate_score:.3f} against stable's "
                f"{s.stable_score:.3f} on {s.items} questions ({s.candidate_right} right, {s.candidate_wrong} wrong "
                f"against {s.stable_right} and {s.stable_wrong}), difference {d:+.3f}, lower bound {lower:+.3f} "
                f"(at least -{margin} at level {level:.2g})")
        (passed if lower >= -margin else failed).append(line)
    return failed, passed


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
    eval_margin: float
    eval_alpha: float

    @classmethod
    def of(cls, cfg: ReleaseSettings) -> GatePolicy:
        return cls(max_length_ratio=cfg.gate_max_length_ratio, max_kl=cfg.gate_max_kl,
                   min_entropy_ratio=cfg.gate_min_entropy_ratio, min_distinct_ratio=cfg.gate_min_distinct_ratio,
                   max_score_drop=cfg.gate_max_score_drop, min_trainer_entropy=cfg.gate_min_trainer_entropy,
                   min_trainer_distinct=cfg.gate_min_trainer_distinct, degeneracy=DegeneracyLimits.of(cfg),
                   eval_margin=cfg.eval_margin, eval_alpha=cfg.eval_alpha)


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
    failed.extend(unmeaning(g.stable_meaning, g.candidate_meaning, policy.degeneracy, 0.0))
    eval_failed, eval_passed = judge_evals(g.evals, policy.eval_margin, policy.eval_alpha)
    if failed or eval_failed:
        return Verdict(Outcome.FAIL, (*eval_failed, *failed, *eval_passed))
    return Verdict(Outcome.PASS, (f"{g.prompts} held-out prompts: every check within its limit", *eval_passed))
