"""The canary and gate judges (release/judge.py), one narrow table test per rule.

Each test starts from a measurement every rule is happy with (RUNNING for the canary, PASS for the
gate) and changes one thing, so a failure names the rule that broke. Limits are checked on both
sides: a value past the limit fails, the value at the limit (or just inside it, where floating
point would make "at" ambiguous) does not.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from flywheel.degeneracy import LENGTH_BUCKETS, TextProfile
from flywheel.settings import ReleaseSettings
from release.judge import (
    ArmStats,
    CanaryMeasurement,
    CanaryPolicy,
    GateMeasurement,
    GatePolicy,
    Outcome,
    PerUser,
    judge_canary,
    judge_gate,
    log_e_sample_ratio,
    per_user_breach,
    t_quantile,
)
from release.sequential import PairCount, e_value, log_e_better

POLICY = CanaryPolicy.of(ReleaseSettings())  # alpha 0.05, min_events 50, deadline 3600 s, error_limit 3, ...


def users(n: int = 100, error: float = 0.01, reject: float = 0.25, flag: float = 0.01, sd: float = 0.0,
          latency: float = 1000.0, length: float = 100.0) -> PerUser:
    """``n`` users' own rates (the sums release/measure.py keeps, built directly): each mean as
    given, with standard deviation ``sd`` across users; every user has rewards. ``latency``: the
    p95 of the users' mean latencies (ms); ``length``: the mean of their mean output lengths."""
    def sq(mean: float) -> float:
        return n * mean * mean + (n - 1) * sd * sd
    return PerUser(users=n, error_sum=n * error, error_sq=sq(error), reject_sum=n * reject, reject_sq=sq(reject),
                   raters=n, flag_sum=n * flag, flag_sq=sq(flag), length_users=n, length_sum=n * length,
                   latency_p95=latency)


ARM = ArmStats(outcomes=200, accepts=60, rejects=100, requests=400, errors=4, latency_ms_p95=1000.0,
               completion_tokens_mean=100.0, flagged=2, rewards=200, per_user=users())
QUIET = PairCount(pairs=200, wins=20, losses=20)  # no evidence either way
BETTER = PairCount(pairs=300, wins=60, losses=10)  # e-value far past 1/alpha for "better"
WORSE = PairCount(pairs=300, wins=10, losses=60)
BASE = CanaryMeasurement(stable=ARM, canary=ARM, pairs=QUIET, elapsed_s=600.0)


def canary(**changes) -> CanaryMeasurement:
    return replace(BASE, canary=replace(ARM, **changes))


def test_the_base_measurement_is_running():
    v = judge_canary(BASE, POLICY)
    assert v.outcome == Outcome.RUNNING
    assert v.reasons == ("20 discordant pairs won by canary, 20 by stable; accept rate 0.300 against 0.300",)


# -- rule 1: measurement errors ------------------------------------------------------------------

def test_error_at_the_error_limit():
    v = judge_canary(replace(BASE, measurement_errors=POLICY.error_limit), POLICY)
    assert v.outcome == Outcome.ERROR
    assert v.reasons == ("3 measurements failed in a row (limit 3)",)


def test_errors_below_the_limit_are_no_verdict():
    assert judge_canary(replace(BASE, measurement_errors=POLICY.error_limit - 1), POLICY).outcome == Outcome.RUNNING


def test_errors_beat_every_other_rule():
    worst = replace(BASE, measurement_errors=5, elapsed_s=10 * POLICY.deadline_s, pairs=BETTER,
                    canary=replace(ARM, outcomes=3, latency_ms_p95=9000.0))
    assert judge_canary(worst, POLICY).outcome == Outcome.ERROR


# -- a minimum sample ----------------------------------------------------------------------------

@pytest.mark.parametrize(("stable_n", "canary_n", "short"), [
    (49, 200, ["stable"]), (200, 49, ["canary"]), (10, 0, ["stable", "canary"])])
def test_running_below_min_events_naming_the_short_arm(stable_n, canary_n, short):
    m = replace(BASE, stable=replace(ARM, outcomes=stable_n), canary=replace(ARM, outcomes=canary_n),
                pairs=BETTER)  # the evidence waits for the minimum too
    v = judge_canary(m, POLICY)
    assert v.outcome == Outcome.RUNNING
    assert [r.split()[0] for r in v.reasons] == short
    n = {"stable": stable_n, "canary": canary_n}
    assert all(f"has {n[name]} of the 50 outcomes needed" in r for name, r in zip(short, v.reasons))


def test_a_short_arm_is_still_held_at_the_deadline():
    # a canary nobody gives feedback on (or that serving never routes to) must not stay forever
    m = replace(BASE, canary=replace(ARM, outcomes=0, requests=0), pairs=BETTER, elapsed_s=POLICY.deadline_s)
    v = judge_canary(m, POLICY)
    assert v.outcome == Outcome.INCONCLUSIVE and any("canary has 0 of the 50 outcomes" in r for r in v.reasons)


def test_guardrails_are_judged_on_requests_served_not_on_outcomes():
    # every canary answer fails, so nobody accepts or rejects it: the error guardrail still fires
    m = replace(BASE, canary=replace(ARM, outcomes=0, accepts=0, rejects=0, requests=400, errors=400,
                                     per_user=users(error=1.0, reject=0.0)), look=1)
    v = judge_canary(m, POLICY)
    assert v.outcome == Outcome.FAIL and v.reasons[0].startswith("guardrail error rate")


def test_too_few_requests_hide_a_breached_guardrail():
    m = replace(BASE, canary=replace(ARM, requests=49, latency_ms_p95=9000.0), look=1)
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


def test_min_events_exactly_is_enough():
    m = replace(BASE, stable=replace(ARM, outcomes=50, accepts=15), canary=replace(ARM, outcomes=50, accepts=15),
                pairs=BETTER)
    assert judge_canary(m, POLICY).outcome == Outcome.PASS


# -- rule 2: guardrails, each alone --------------------------------------------------------------

# name in the reason, canary fields past the limit, canary fields at / just inside it
# (stable: p95 1000 ms, 100 tokens; its users' own rates: errors 0.01, rejects 0.25, flags 0.01,
# alike across users, so there is no noise and the limit is exact)
GUARDRAILS = [
    ("guardrail error rate", {"per_user": users(error=0.0305)}, {"per_user": users(error=0.0295)}),  # +0.02
    ("guardrail latency", {"per_user": users(latency=1500.5)}, {"per_user": users(latency=1500.0)}),  # x1.5
    ("guardrail output length", {"per_user": users(length=200.5)}, {"per_user": users(length=200.0)}),  # x2
    ("guardrail output length", {"per_user": users(length=49.5)}, {"per_user": users(length=50.0)}),  # /2
    ("guardrail share of rejects", {"per_user": users(reject=0.4005)}, {"per_user": users(reject=0.3995)}),  # +0.15
    ("guardrail reward-guard flags", {"per_user": users(flag=0.0605)}, {"per_user": users(flag=0.0595)}),  # +0.05
]


@pytest.mark.parametrize(("name", "past", "inside"), GUARDRAILS,
                         ids=["error-rate", "latency", "longer", "shorter", "rejects", "flags"])
def test_a_breached_guardrail_fails_naming_it(name, past, inside):
    v = judge_canary(replace(canary(**past), look=1), POLICY)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith(name + ":"), v.reasons


@pytest.mark.parametrize(("name", "past", "inside"), GUARDRAILS,
                         ids=["error-rate", "latency", "longer", "shorter", "rejects", "flags"])
def test_a_guardrail_just_inside_its_limit_does_not_fail(name, past, inside):
    assert judge_canary(replace(canary(**inside), look=1), POLICY).outcome == Outcome.RUNNING


@pytest.mark.parametrize("what", [{"per_user": users(error=0.9)}, {"per_user": users(reject=0.9)},
                                  {"per_user": users(flag=0.9)}, {"per_user": users(latency=5000.0)},
                                  {"per_user": users(length=900.0)}],
                         ids=["error", "reject", "flag", "latency", "length"])
def test_the_guardrails_are_judged_only_at_a_look(what):
    # judged on every tick, a test at one level (or a fixed ratio of a noisy estimate) is another
    # chance at a false rollback each tick
    m = canary(**what)
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING
    assert judge_canary(replace(m, look=3), POLICY).outcome == Outcome.FAIL


# users a side, canary's mean and sd of their share of rejects, stable's, breached at look 1
@pytest.mark.parametrize("n, c_mean, c_sd, s_mean, s_sd, breached", [
    (25, 0.76, 0.3, 0.60, 0.3, False),  # +0.16 over 25 users a side: noise
    (25, 1.00, 0.0, 0.40, 0.3, True),  # every canary user rejects everything: far past noise
    (400, 0.425, 0.3, 0.25, 0.3, False),  # +0.175: 0.025 past the allowance, within noise over 400 users
    (400, 0.55, 0.3, 0.25, 0.3, True),  # +0.30: 0.15 past it, seven standard errors
])
def test_a_rate_guardrail_breaches_only_beyond_the_noise_between_users(n, c_mean, c_sd, s_mean, s_sd, breached):
    m = replace(BASE, stable=replace(ARM, per_user=users(n, reject=s_mean, sd=s_sd)),
                canary=replace(ARM, per_user=users(n, reject=c_mean, sd=c_sd)), look=1)
    assert (judge_canary(m, POLICY).outcome == Outcome.FAIL) is breached


def test_heavy_users_weigh_as_the_few_users_they_are():
    """The audit's case: per request, 0.867 of the canary's answers rejected against 0.440 of
    stable's, because two heavy users who reject everything landed on the canary. Per user it is
    2 of 30 users against none: noise, no rollback."""
    light = [0.40] * 14 + [0.44] * 14  # the other users, alike in both arms
    def arm(rates: list[float], requests: int, rejects: int) -> ArmStats:
        pu = PerUser(users=len(rates), reject_sum=sum(rates), reject_sq=sum(r * r for r in rates))
        return replace(ARM, requests=requests, rejects=rejects, per_user=pu)
    stable = arm(light + [0.44, 0.44], requests=500, rejects=220)  # 0.440 of requests
    canary_ = arm(light + [1.0, 1.0], requests=1500, rejects=1300)  # 0.867: the heavy two sent 1,000
    assert canary_.reject_share - stable.reject_share > 0.4
    assert judge_canary(replace(BASE, stable=stable, canary=canary_, look=1), POLICY).outcome == Outcome.RUNNING


@pytest.mark.parametrize("canary_, stable_, allowance, level, breach", [
    ((30, 30 * 0.5, 30 * 0.25), (30, 30 * 0.5, 30 * 0.25), 0.0, 0.01, None),  # alike, each user 0.5
    ((30, 30.0, 30.0), (30, 0.0, 0.0), 0.15, 1e-9, (1.0, 0.0)),  # no noise: past the allowance is a breach
    ((30, 30.0, 30.0), (30, 0.0, 0.0), 1.0, 0.01, None),  # ... not past it
    ((1, 1.0, 1.0), (30, 0.0, 0.0), 0.0, 0.01, None),  # one user is no comparison
    ((30, math.nan, math.nan), (30, 0.0, 0.0), 0.0, 0.01, (math.nan, 0.0)),  # a NaN breaches
])
def test_per_user_breach(canary_, stable_, allowance, level, breach):
    got = per_user_breach(canary_, stable_, allowance, level)
    if breach is None:
        assert got is None
    else:
        assert got is not None and all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, breach))


@pytest.mark.parametrize("p, df, exact", [
    (0.999, 10, 4.1437), (0.9995, 20, 3.8495), (0.999, 30, 3.3852), (0.975, 5, 2.5706), (0.99, 1e9, 2.3263)])
def test_t_quantile_within_a_percent_of_students(p, df, exact):
    assert t_quantile(p, df) == pytest.approx(exact, rel=0.01)


# -- rule 3: the sample-ratio check -------------------------------------------------------------

def split(canary_users: int, stable_users: int, share: float | None = 0.5) -> CanaryMeasurement:
    return replace(BASE, canary=replace(ARM, per_user=users(canary_users)),
                   stable=replace(ARM, per_user=users(stable_users)), canary_share=share, pairs=BETTER)


@pytest.mark.parametrize("canary_users, stable_users, share, held", [
    (100, 100, 0.5, False),  # the split asked for
    (110, 90, 0.5, False),  # 0.55 over 200 users: chance
    (150, 50, 0.5, True),  # 0.75 where 0.5 was asked: held, even with a PASS in the evidence
    (100, 900, 0.1, False),
    (300, 700, 0.1, True),  # the share changed mid-canary, or users picked the canary
    (20, 980, 0.1, True),  # routing applied late: few users ever reached the canary
    (300, 700, None, False),  # no share known (a tally of older code): not judged
])
def test_a_sample_ratio_mismatch_holds_the_canary_saying_why(canary_users, stable_users, share, held):
    v = judge_canary(split(canary_users, stable_users, share), POLICY)
    assert (v.outcome == Outcome.HOLD) is held
    if held:
        assert v.reasons[0].startswith(f"sample ratio mismatch: {canary_users} users on the canary and "
                                       f"{stable_users} on stable"), v.reasons
    else:
        assert v.outcome == Outcome.PASS


def test_a_sample_ratio_mismatch_holds_only_past_one_over_srm_alpha():
    # the e-value crosses 1/srm_alpha between these counts, and not before
    before, after = (130, 70), (160, 40)
    assert log_e_sample_ratio(*before, 0.5) < math.log(1 / POLICY.srm_alpha) <= log_e_sample_ratio(*after, 0.5)
    assert judge_canary(split(*before), POLICY).outcome == Outcome.PASS
    assert judge_canary(split(*after), POLICY).outcome == Outcome.HOLD


def test_the_sample_ratio_e_value_is_a_martingale_at_the_routings_share():
    """Its mean under the share asked for is 1 at every count (exactly: a sum over the binomial),
    which is what makes it valid at every tick (Ville)."""
    for share in (0.1, 0.5):
        for n in (1, 10, 60):
            mean = sum(math.comb(n, c) * share ** c * (1 - share) ** (n - c) * math.exp(log_e_sample_ratio(c, n - c, share))
                       for c in range(n + 1))
            assert mean == pytest.approx(1.0, rel=1e-9)


def test_a_breached_guardrail_beats_a_sample_ratio_mismatch():
    m = replace(split(150, 50), canary=replace(ARM, per_user=users(150, error=0.9)), look=1)
    assert judge_canary(m, POLICY).outcome == Outcome.FAIL


def test_p95_latency_is_compared_only_over_enough_users():
    def arms(n: int) -> CanaryMeasurement:
        return replace(BASE, stable=replace(ARM, per_user=users(n)), canary=replace(ARM, per_user=users(n, latency=1600.0)),
                       look=1)

    assert judge_canary(arms(39), POLICY).outcome == Outcome.RUNNING  # over 39 users a p95 is their slowest two
    assert judge_canary(arms(40), POLICY).reasons[0].startswith("guardrail latency:")


def test_a_heavy_user_counts_once_in_latency_and_length():
    """The guardrails read each user's mean (release/measure.py): one user sending 200 slow, long
    requests among 99 who send 2 moves the per-request p95 and mean, not the per-user ones."""
    from release.measure import Arm

    def arm(heavy: bool) -> Arm:
        a = Arm()
        for u in range(100):
            n, latency, tokens = (200, 9000.0, 400) if heavy and u == 0 else (2, 1000.0, 100)
            for _ in range(n):
                a.requests += 1
                a.latencies_ms.append(latency)
                a.tokens += tokens
                for what, amount in ((0, 1), (5, tokens), (6, latency)):
                    a.count(f"u{u}", what, amount)
        return a

    canary, stable = arm(heavy=True).stats(), arm(heavy=False).stats()
    assert canary.latency_ms_p95 == 9000.0 and canary.completion_tokens_mean > 2 * stable.completion_tokens_mean
    m = replace(BASE, stable=replace(stable, outcomes=200), canary=replace(canary, outcomes=200), look=2)
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


def test_an_ignored_answer_is_no_reject():
    # fewer accepts, the same explicit rejects: the users ignored more answers, which the
    # reject-share guardrail does not count (the accept-rate test judges accepts)
    assert judge_canary(canary(accepts=20), POLICY).outcome == Outcome.RUNNING


def test_guardrails_compare_with_stable_not_absolute():
    # a canary as slow and error-prone as stable breaches nothing, however bad both are
    bad = replace(ARM, errors=200, latency_ms_p95=30_000.0, flagged=150, per_user=users(error=0.5, flag=0.75))
    assert judge_canary(replace(BASE, stable=bad, canary=bad, look=1), POLICY).outcome == Outcome.RUNNING


def test_an_unmeasured_stable_latency_or_length_is_not_compared():
    stable = replace(ARM, per_user=users(latency=0.0, length=0.0))
    m = replace(BASE, stable=stable, canary=replace(ARM, per_user=users(latency=5000.0, length=900.0)), look=1)
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


@pytest.mark.parametrize("field", ["latency", "length"])
def test_a_non_finite_canary_measurement_breaches_its_guardrail(field):
    m = replace(canary(per_user=users(**{field: math.nan})), look=1)
    assert judge_canary(m, POLICY).outcome == Outcome.FAIL


def test_every_breached_guardrail_is_named():
    v = judge_canary(replace(canary(per_user=users(error=0.1, flag=0.25, latency=4000.0)), look=1), POLICY)
    assert v.outcome == Outcome.FAIL
    assert [r.split(":")[0] for r in v.reasons] == [
        "guardrail latency", "guardrail error rate", "guardrail reward-guard flags"]


def test_a_breached_guardrail_beats_a_passing_accept_rate():
    v = judge_canary(replace(canary(per_user=users(latency=2000.0)), pairs=BETTER, look=1), POLICY)
    assert v.outcome == Outcome.FAIL and v.reasons[0].startswith("guardrail latency:")


# -- rules 4 and 5: the always-valid test --------------------------------------------------------

def test_fail_when_the_canary_is_clearly_accepted_less_often():
    v = judge_canary(replace(BASE, pairs=WORSE), POLICY)
    assert v.outcome == Outcome.FAIL
    assert v.reasons[0].startswith("canary accepted less often (e-value ")
    assert "10 discordant pairs won by canary, 60 by stable" in v.reasons[0]


def test_pass_when_the_canary_is_clearly_accepted_more_often():
    v = judge_canary(replace(BASE, pairs=BETTER), POLICY)
    assert v.outcome == Outcome.PASS
    assert v.reasons[0].startswith("canary accepted more often (e-value ")
    assert ">= 20)" in v.reasons[0]


def first_passing_wins(losses: int, alpha: float) -> int:
    w = losses
    while log_e_better(PairCount(0, w, losses)) < math.log(1 / alpha):
        w += 1
    return w


@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_pass_exactly_where_the_e_value_reaches_one_over_alpha(alpha):
    policy = replace(POLICY, alpha=alpha)
    w = first_passing_wins(10, alpha)
    assert judge_canary(replace(BASE, pairs=PairCount(300, w - 1, 10)), policy).outcome == Outcome.RUNNING
    assert judge_canary(replace(BASE, pairs=PairCount(300, w, 10)), policy).outcome == Outcome.PASS
    # mirrored: the same counts the other way round fail
    assert judge_canary(replace(BASE, pairs=PairCount(300, 10, w)), policy).outcome == Outcome.FAIL
    assert judge_canary(replace(BASE, pairs=PairCount(300, 10, w - 1)), policy).outcome == Outcome.RUNNING


# Past log e ~ 709.8 an e-value is no longer a float: about 1,200 all-loss discordant pairs get
# there, and a clear loser on a long canary gets there surely. The verdict must still come.
@pytest.mark.parametrize(("pairs", "outcome", "words"), [
    (PairCount(1500, 0, 1500), Outcome.FAIL, "canary accepted less often (e-value "),
    (PairCount(1500, 1500, 0), Outcome.PASS, "canary accepted more often (e-value "),
    (PairCount(10**6, 0, 10**6), Outcome.FAIL, "canary accepted less often (e-value "),
], ids=["1500-losses", "1500-wins", "a-million-losses"])
def test_an_e_value_past_the_float_range_still_gives_a_verdict(pairs, outcome, words):
    v = judge_canary(replace(BASE, pairs=pairs), POLICY)
    assert v.outcome == outcome
    assert v.reasons[0].startswith(words) and "inf" not in v.reasons[0], v.reasons


@pytest.mark.parametrize(("log_e", "shown"), [
    (0.0, 1.0), (math.log(20), 20.0), (700.0, math.exp(700.0)), (709.8, math.exp(700.0)), (1e6, math.exp(700.0)),
    (float("inf"), math.exp(700.0)), (-1e6, 0.0)])
def test_e_values_are_capped_finite(log_e, shown):
    assert e_value(log_e) == pytest.approx(shown) and math.isfinite(e_value(log_e))


def test_pass_is_tested_at_the_canarys_own_level_and_fail_at_alpha():
    """The deployment's budget (release/budget.py pass_level) gives each canary its PASS
    level; a rollback stays at alpha."""
    mine = replace(POLICY, pass_alpha=0.005)
    w = first_passing_wins(10, 0.005)
    assert w > first_passing_wins(10, 0.05)
    assert judge_canary(replace(BASE, pairs=PairCount(300, w - 1, 10)), mine).outcome == Outcome.RUNNING
    v = judge_canary(replace(BASE, pairs=PairCount(300, w, 10)), mine)
    assert v.outcome == Outcome.PASS and ">= 200, this canary's level 0.005)" in v.reasons[0]
    fail_at = first_passing_wins(10, 0.05)  # mirrored: FAIL needs only alpha's evidence
    assert judge_canary(replace(BASE, pairs=PairCount(300, 10, fail_at)), mine).outcome == Outcome.FAIL


def test_the_reasons_say_how_many_flagged_users_were_left_out():
    m = replace(BASE, excluded_users=3, flagged_after_counting=1, canary=replace(ARM, excluded=2, pending=4))
    v = judge_canary(m, POLICY)
    assert v.reasons == (("20 discordant pairs won by canary, 20 by stable; accept rate 0.300 against 0.300; "
                          "3 users flagged by reward's guards left out (1 after their outcome counted)"),)


def test_a_smaller_alpha_asks_for_more_evidence():
    assert first_passing_wins(10, 0.01) > first_passing_wins(10, 0.05)


# -- rules 6 and 7: the deadline, and otherwise running ------------------------------------------

def test_inconclusive_past_the_deadline_without_evidence():
    v = judge_canary(replace(BASE, elapsed_s=POLICY.deadline_s), POLICY)
    assert v.outcome == Outcome.INCONCLUSIVE
    assert v.reasons[0].startswith("no verdict after 3600s (deadline 3600s): 20 discordant pairs")


def test_evidence_past_the_deadline_still_decides():
    late = replace(BASE, elapsed_s=2 * POLICY.deadline_s)
    assert judge_canary(replace(late, pairs=BETTER), POLICY).outcome == Outcome.PASS
    assert judge_canary(replace(late, pairs=WORSE), POLICY).outcome == Outcome.FAIL


def test_running_before_the_deadline_without_evidence():
    assert judge_canary(replace(BASE, elapsed_s=POLICY.deadline_s - 1), POLICY).outcome == Outcome.RUNNING


# -- the offline gate ----------------------------------------------------------------------------

GATE_POLICY = GatePolicy.of(ReleaseSettings())  # length x2, KL 1.0, entropy x0.5, distinct x0.8, score -0.1, trainer 0.05 / 0.2
GATE = GateMeasurement(prompts=32, stable_length_mean=20.0, candidate_length_mean=22.0, kl_from_stable=0.2,
                       stable_entropy=2.0, candidate_entropy=1.8, stable_distinct=1.0, candidate_distinct=0.9,
                       scores={"verifier": (0.6, 0.58), "labeler": (0.7, 0.72)},
                       trainer_metrics={"entropy": 1.2, "distinct_frac": 0.7})


def test_gate_passes_when_every_check_is_within_its_limit():
    v = judge_gate(GATE, GATE_POLICY)
    assert v.outcome == Outcome.PASS
    assert v.reasons == ("32 held-out prompts: every check within its limit",)


# reason prefix, changes past the limit, changes at / just inside it
GATE_RULES = [
    ("output length drift", {"candidate_length_mean": 40.5}, {"candidate_length_mean": 40.0}),
    ("output length drift", {"candidate_length_mean": 9.5}, {"candidate_length_mean": 10.0}),
    ("KL from stable", {"kl_from_stable": 1.01}, {"kl_from_stable": 1.0}),
    ("per-token entropy", {"candidate_entropy": 0.99}, {"candidate_entropy": 1.0}),
    ("distinct completions", {"candidate_distinct": 0.79}, {"candidate_distinct": 0.8}),
    ("verifier", {"scores": {"verifier": (0.6, 0.49)}}, {"scores": {"verifier": (0.6, 0.51)}}),
    ("the trainer reports policy entropy", {"trainer_metrics": {"entropy": 0.04, "distinct_frac": 0.7}},
     {"trainer_metrics": {"entropy": 0.05, "distinct_frac": 0.7}}),
    ("the trainer reports 0.19 distinct", {"trainer_metrics": {"entropy": 1.2, "distinct_frac": 0.19}},
     {"trainer_metrics": {"entropy": 1.2, "distinct_frac": 0.2}}),
]
GATE_IDS = ["longer", "shorter", "kl", "entropy-ratio", "distinct-ratio", "score-drop", "trainer-entropy",
            "trainer-distinct"]


@pytest.mark.parametrize(("name", "past", "inside"), GATE_RULES, ids=GATE_IDS)
def test_gate_fails_a_check_past_its_limit_naming_it(name, past, inside):
    v = judge_gate(replace(GATE, **past), GATE_POLICY)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith(name), v.reasons


@pytest.mark.parametrize(("name", "past", "inside"), GATE_RULES, ids=GATE_IDS)
def test_gate_passes_a_check_at_its_limit(name, past, inside):
    assert judge_gate(replace(GATE, **inside), GATE_POLICY).outcome == Outcome.PASS


def test_gate_a_score_that_rises_or_is_new_is_no_failure():
    assert judge_gate(replace(GATE, scores={"verifier": (0.1, 0.9)}), GATE_POLICY).outcome == Outcome.PASS
    assert judge_gate(replace(GATE, scores={}, trainer_metrics={}), GATE_POLICY).outcome == Outcome.PASS


def test_gate_names_every_failed_check():
    g = replace(GATE, kl_from_stable=3.0, candidate_distinct=0.1,
                scores={"verifier": (0.6, 0.1), "labeler": (0.9, 0.2)})
    v = judge_gate(g, GATE_POLICY)
    assert v.outcome == Outcome.FAIL
    assert [r.split()[0] for r in v.reasons] == ["KL", "distinct", "labeler:", "verifier:"]


def test_gate_an_empty_prompt_set_is_an_error_whatever_else():
    v = judge_gate(replace(GATE, prompts=0, kl_from_stable=9.0), GATE_POLICY)
    assert v.outcome == Outcome.ERROR and v.reasons == ("the held-out prompt set is empty",)


@pytest.mark.parametrize("changes", [
    {"kl_from_stable": math.nan}, {"candidate_entropy": math.nan}, {"candidate_distinct": math.nan},
    {"candidate_length_mean": math.inf}, {"scores": {"verifier": (0.6, math.nan)}},
    {"trainer_metrics": {"entropy": math.nan}}, {"trainer_metrics": {"distinct_frac": math.nan}}],
    ids=["kl", "entropy", "distinct", "length", "score", "trainer-entropy", "trainer-distinct"])
def test_gate_fails_a_non_finite_measurement(changes):
    # a diverged candidate measures NaN: the gate must not wave it through
    assert judge_gate(replace(GATE, **changes), GATE_POLICY).outcome == Outcome.FAIL


# -- degeneracy: stable's answers against the candidate's, at the gate and on the canary -----------

def profile(n: int = 100, repetition: float = 0.15, vowels: float = 0.30, collapsed: int = 0,
            sd: float = 0.0) -> TextProfile:
    """``n`` answers (flywheel/degeneracy.py's sums, built directly): mean repetition and vowel share
    as given, each with standard deviation ``sd`` across answers; 20% spaces, consonants and other
    characters giving way to vowels half each (so vowels move most); ``collapsed`` of the answers 1
    visible character long, the others 16-31 (stable's median bucket is 5)."""
    def sq(mean: float) -> float:
        return n * mean * mean + (n - 1) * sd * sd
    d = (vowels - 0.3) / 2
    shares = (vowels, 0.4 - d, 0.0, 0.2, 0.1 - d)
    lengths = [0] * LENGTH_BUCKETS
    lengths[1], lengths[5] = collapsed, n - collapsed
    return TextProfile(answers=n, repetition_sum=n * repetition, repetition_sq=sq(repetition), classed=n,
                       class_sum=tuple(n * s for s in shares), class_sq=tuple(sq(s) for s in shares),
                       lengths=tuple(lengths))


# reason prefix, candidate profile past the limit, at / just inside it (stable: profile())
DEGENERACY = [
    ("character repetition", {"repetition": 0.2005}, {"repetition": 0.199}),  # +0.05
    ("character-class stuffing: vowels", {"vowels": 0.4505}, {"vowels": 0.449}),  # +-0.15
    ("character-class stuffing: vowels", {"vowels": 0.1495}, {"vowels": 0.151}),  # a class that falls
    ("length collapse", {"collapsed": 26}, {"collapsed": 25}),  # +0.25
]
DEGENERACY_IDS = ["repetition", "vowels-up", "vowels-down", "collapse"]


@pytest.mark.parametrize(("name", "past", "inside"), DEGENERACY, ids=DEGENERACY_IDS)
def test_gate_fails_degenerate_answers_naming_the_check(name, past, inside):
    v = judge_gate(replace(GATE, stable_text=profile(), candidate_text=profile(**past)), GATE_POLICY)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith(name), v.reasons
    assert judge_gate(replace(GATE, stable_text=profile(), candidate_text=profile(**inside)),
                      GATE_POLICY).outcome == Outcome.PASS


def test_gate_judges_degeneracy_against_stable_not_absolute():
    # a model vowel-rich, repetitive and terse from the start is no reason to reject its successor
    odd = profile(repetition=0.6, vowels=0.7, collapsed=40)
    assert judge_gate(replace(GATE, stable_text=odd, candidate_text=odd), GATE_POLICY).outcome == Outcome.PASS


def test_gate_degeneracy_is_a_point_estimate_on_the_held_out_prompts():
    # one look, a fixed prompt set: no allowance for noise beyond the limit itself
    noisy = replace(GATE, stable_text=profile(n=24, sd=0.2), candidate_text=profile(n=24, repetition=0.21, sd=0.2))
    assert judge_gate(noisy, GATE_POLICY).outcome == Outcome.FAIL


# on the canary, at a look: clearly past each limit (the look's level adds its noise allowance)
CANARY_DEGENERACY = [
    ("character repetition", {"repetition": 0.25}, {"repetition": 0.199}),
    ("character-class stuffing: vowels", {"vowels": 0.5}, {"vowels": 0.449}),
    ("character-class stuffing: vowels", {"vowels": 0.1}, {"vowels": 0.151}),
    ("length collapse", {"collapsed": 60}, {"collapsed": 25}),
]


@pytest.mark.parametrize(("name", "past", "inside"), CANARY_DEGENERACY, ids=DEGENERACY_IDS)
def test_a_degenerate_canary_breaches_its_guardrail_at_a_look(name, past, inside):
    m = replace(BASE, stable=replace(ARM, text=profile()), canary=replace(ARM, text=profile(**past)), look=1)
    v = judge_canary(m, POLICY)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith("guardrail " + name), v.reasons
    assert judge_canary(replace(m, look=0), POLICY).outcome == Outcome.RUNNING  # no look, no verdict on it
    m = replace(m, canary=replace(ARM, text=profile(**inside)))
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


@pytest.mark.parametrize("n, breached", [(30, False), (2000, True)])
def test_a_degeneracy_guardrail_breaches_only_beyond_sampling_noise(n, breached):
    # +0.08 repetition, 0.03 past the allowance: within noise over 30 answers a side (standard
    # error 0.026), eight standard errors over 2,000
    m = replace(BASE, stable=replace(ARM, text=profile(n=n, sd=0.1)),
                canary=replace(ARM, text=profile(n=n, repetition=0.23, sd=0.1)), look=1)
    assert (judge_canary(m, POLICY).outcome == Outcome.FAIL) is breached


def test_arms_without_answers_compare_no_degeneracy():
    assert judge_canary(replace(BASE, canary=replace(ARM, text=profile())), POLICY).outcome == Outcome.RUNNING


# -- one definition per setting ----------------------------------------------------------------

#: Policy field -> the ``[release]`` setting it is read from (the gate's carry a ``gate_`` prefix).
CANARY_FIELDS = {f: f for f in ("alpha", "min_events", "deadline_s", "error_limit", "max_error_rate_increase",
                                "max_latency_ratio", "max_length_ratio", "guardrail_alpha", "srm_alpha",
                                "max_reject_share_increase", "max_flag_rate_increase")}
GATE_FIELDS = {**{f: f"gate_{f}" for f in ("max_length_ratio", "max_kl", "min_entropy_ratio", "min_distinct_ratio",
                                           "max_score_drop", "min_trainer_entropy", "min_trainer_distinct")},
               "eval_margin": "eval_margin", "eval_alpha": "eval_alpha"}
DEGENERACY_FIELDS = ("max_repetition_increase", "max_char_class_shift", "max_collapse_increase",
                     "max_leading_share_increase", "max_shared_affix_increase", "max_unrelated_increase")


@pytest.mark.parametrize("policy, mapping", [(CanaryPolicy, CANARY_FIELDS), (GatePolicy, GATE_FIELDS)])
def test_policies_repeat_no_default_and_read_every_limit_from_its_setting(policy, mapping):
    """A limit with a default of its own in the dataclass drifts from its setting's (the gate's
    trainer thresholds were such defaults, and no setting moved them)."""
    from dataclasses import MISSING, fields

    own = {f.name for f in fields(policy) if f.default is not MISSING or f.default_factory is not MISSING}
    assert own <= {"pass_alpha"}, f"{policy.__name__} repeats defaults: {sorted(own)}"
    assert set(mapping) | {"degeneracy"} == {f.name for f in fields(policy)} - {"pass_alpha"}
    base = ReleaseSettings()
    # every setting moved off its default, inside its bounds (a tenth down: ratios stay over 1)
    moved = {name: type(getattr(base, name))(getattr(base, name) * 0.9)
             for name in (*mapping.values(), *DEGENERACY_FIELDS)}
    built = policy.of(ReleaseSettings(**moved))
    for field_name, setting in mapping.items():
        assert getattr(built, field_name) == moved[setting] != getattr(base, setting), field_name
    for name in DEGENERACY_FIELDS:
        assert getattr(built.degeneracy, name) == moved[name] != getattr(base, name), name
    # the canary's distinct-answers limit is its own; the gate compares distinct completions itself
    canary = CanaryPolicy.of(ReleaseSettings(min_distinct_ratio=0.5)).degeneracy.min_distinct_ratio
    assert (canary, GatePolicy.of(ReleaseSettings()).degeneracy.min_distinct_ratio) == (0.5, None)


# -- the guardrails' error rate with heavy users -------------------------------------------------

def test_identical_versions_with_heavy_users_are_rolled_back_at_most_guardrail_alpha():
    """The audit's scenario, simulated (seeded): users of two tastes (reject 10% or 80% of
    answers) and heavy-tailed traffic (Pareto, a few users send most requests), each placed on an
    arm by a coin, both arms served by the same version. Through :func:`judge_tick` as the
    controller calls it, on the ticks where a look falls due (between them it judges no rate
    guardrail): the per-request share of rejects of the two arms differs by more than the 0.15
    allowance in many canaries (what a per-request test sees), yet the per-user guardrails roll
    back at most ``guardrail_alpha`` of them (plus three standard errors of the simulation)."""
    import numpy as np

    from release.budget import look_due
    from release.judge import judge_tick

    rng = np.random.default_rng(45)
    runs, n = 1000, 320
    rolled = apart = 0
    for _ in range(runs):
        requests = np.minimum(np.ceil(rng.pareto(1.1, n) * 3), 2_000)
        rejects = rng.binomial(requests.astype(int), np.where(rng.random(n) < 0.5, 0.1, 0.8))
        side = rng.random(n) < 0.5
        rate = rejects / requests
        # per arm, after each user: users, requests, rejects, sum of rates, sum of squares
        cum = [np.cumsum(np.stack([s, requests * s, rejects * s, rate * s, rate * rate * s]), axis=1)
               for s in (~side, side)]
        looks, verdict = 0, None
        for i in range(n):
            if not look_due(int(min(cum[0][0, i], cum[1][0, i])), looks):
                continue
            arms = [replace(ARM, requests=int(c[1, i]), rejects=int(c[2, i]),
                            per_user=PerUser(users=int(c[0, i]), reject_sum=c[3, i], reject_sq=c[4, i]))
                    for c in cum]
            verdict, looks = judge_tick(replace(BASE, stable=arms[0], canary=arms[1]), POLICY, looks)
            if verdict.outcome == Outcome.FAIL:
                break
        rolled += verdict is not None and verdict.outcome == Outcome.FAIL
        apart += (cum[1][2, -1] / cum[1][1, -1] - cum[0][2, -1] / cum[0][1, -1]) > POLICY.max_reject_share_increase
    alpha = POLICY.guardrail_alpha
    assert apart / runs > 0.05, apart  # heavy users move the per-request share past the allowance
    assert rolled / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), rolled
