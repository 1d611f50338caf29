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
    judge_canary,
    judge_gate,
)
from release.sequential import PairCount, e_value, log_e_better

POLICY = CanaryPolicy.of(ReleaseSettings())  # alpha 0.05, min_events 50, deadline 3600 s, error_limit 3, ...
EXACT = replace(POLICY, guardrail_z=0.0)  # guardrails on point estimates: their limits, exactly
ARM = ArmStats(outcomes=200, accepts=60, rejects=100, requests=400, errors=4, latency_ms_p95=1000.0,
               completion_tokens_mean=100.0, flagged=2, rewards=200)
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
    m = replace(BASE, canary=replace(ARM, outcomes=0, accepts=0, rejects=0, requests=400, errors=400))
    v = judge_canary(m, POLICY)
    assert v.outcome == Outcome.FAIL and v.reasons[0].startswith("guardrail error rate")


def test_too_few_requests_hide_a_breached_guardrail():
    m = replace(BASE, canary=replace(ARM, requests=49, latency_ms_p95=9000.0))
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


def test_min_events_exactly_is_enough():
    m = replace(BASE, stable=replace(ARM, outcomes=50, accepts=15), canary=replace(ARM, outcomes=50, accepts=15),
                pairs=BETTER)
    assert judge_canary(m, POLICY).outcome == Outcome.PASS


# -- rule 3: guardrails, each alone --------------------------------------------------------------

# name in the reason, canary fields past the limit, canary fields at / just inside it
# (stable: 4/400 errors, p95 1000 ms, 100 tokens, 100/400 explicit rejects, 2/200 flags)
GUARDRAILS = [
    ("guardrail error rate", {"errors": 13}, {"errors": 11}),  # +0.0225 / +0.0175 (limit +0.02)
    ("guardrail latency", {"latency_ms_p95": 1500.5}, {"latency_ms_p95": 1500.0}),  # x1.5
    ("guardrail output length", {"completion_tokens_mean": 200.5}, {"completion_tokens_mean": 200.0}),  # x2
    ("guardrail output length", {"completion_tokens_mean": 49.5}, {"completion_tokens_mean": 50.0}),  # /2
    ("guardrail share of rejects", {"rejects": 161}, {"rejects": 159}),  # +0.1525 / +0.1475 (limit +0.15)
    ("guardrail reward-guard flags", {"flagged": 13}, {"flagged": 11}),  # +0.055 / +0.045 (limit +0.05)
]


@pytest.mark.parametrize(("name", "past", "inside"), GUARDRAILS,
                         ids=["error-rate", "latency", "longer", "shorter", "rejects", "flags"])
def test_a_breached_guardrail_fails_naming_it(name, past, inside):
    v = judge_canary(canary(**past), EXACT)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith(name + ":"), v.reasons


@pytest.mark.parametrize(("name", "past", "inside"), GUARDRAILS,
                         ids=["error-rate", "latency", "longer", "shorter", "rejects", "flags"])
def test_a_guardrail_just_inside_its_limit_does_not_fail(name, past, inside):
    assert judge_canary(canary(**inside), EXACT).outcome == Outcome.RUNNING


@pytest.mark.parametrize("requests, rejects, stable_rejects, breached", [
    (25, 19, 15, False),  # 0.76 against 0.60 over 25 answers each: noise (seen rolling back a good canary)
    (25, 25, 10, True),  # every answer rejected against 40%: far past noise
    (400, 310, 240, False),  # +0.175 over 400 each: 0.025 past the allowance, well within noise
    (400, 360, 240, True),  # +0.30 over 400 each: 0.15 past it, five standard errors
])
def test_a_rate_guardrail_breaches_only_beyond_sampling_noise(requests, rejects, stable_rejects, breached):
    stable = replace(ARM, requests=requests, rejects=stable_rejects, outcomes=requests, accepts=0)
    m = replace(BASE, stable=stable, canary=replace(stable, rejects=rejects))
    few = replace(POLICY, min_events=20)
    assert (judge_canary(m, few).outcome == Outcome.FAIL) is breached
    assert judge_canary(m, replace(few, guardrail_z=0.0)).outcome == Outcome.FAIL  # every point estimate is past it


def test_p95_latency_is_compared_only_over_enough_requests():
    few = replace(POLICY, min_events=20)

    def arms(n: int) -> CanaryMeasurement:
        stable = replace(ARM, requests=n, rejects=n // 4, errors=0)
        return replace(BASE, stable=stable, canary=replace(stable, latency_ms_p95=1600.0))

    assert judge_canary(arms(60), few).outcome == Outcome.RUNNING  # over 60 requests a p95 is their slowest three
    assert judge_canary(arms(100), few).reasons[0].startswith("guardrail latency:")


def test_an_ignored_answer_is_no_reject():
    # fewer accepts, the same explicit rejects: the users ignored more answers, which the
    # reject-share guardrail does not count (the accept-rate test judges accepts)
    assert judge_canary(canary(accepts=20), POLICY).outcome == Outcome.RUNNING


def test_guardrails_compare_with_stable_not_absolute():
    # a canary as slow and error-prone as stable breaches nothing, however bad both are
    bad = replace(ARM, errors=200, latency_ms_p95=30_000.0, flagged=150)
    assert judge_canary(replace(BASE, stable=bad, canary=bad), POLICY).outcome == Outcome.RUNNING


def test_an_unmeasured_stable_latency_or_length_is_not_compared():
    stable = replace(ARM, latency_ms_p95=0.0, completion_tokens_mean=0.0)
    m = replace(BASE, stable=stable, canary=replace(ARM, latency_ms_p95=5000.0, completion_tokens_mean=900.0))
    assert judge_canary(m, POLICY).outcome == Outcome.RUNNING


@pytest.mark.parametrize("field", ["latency_ms_p95", "completion_tokens_mean"])
def test_a_non_finite_canary_measurement_breaches_its_guardrail(field):
    assert judge_canary(canary(**{field: math.nan}), POLICY).outcome == Outcome.FAIL


def test_every_breached_guardrail_is_named():
    v = judge_canary(canary(errors=40, latency_ms_p95=4000.0, flagged=50), POLICY)
    assert v.outcome == Outcome.FAIL
    assert [r.split(":")[0] for r in v.reasons] == [
        "guardrail error rate", "guardrail latency", "guardrail reward-guard flags"]


def test_a_breached_guardrail_beats_a_passing_accept_rate():
    v = judge_canary(replace(canary(latency_ms_p95=2000.0), pairs=BETTER), POLICY)
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
    """The deployment's budget (release/sequential.py canary_alpha) gives each canary its PASS
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


@pytest.mark.parametrize(("name", "past", "inside"), DEGENERACY, ids=DEGENERACY_IDS)
def test_a_degenerate_canary_breaches_its_guardrail(name, past, inside):
    m = replace(BASE, stable=replace(ARM, text=profile()), canary=replace(ARM, text=profile(**past)))
    v = judge_canary(m, EXACT)
    assert v.outcome == Outcome.FAIL
    assert len(v.reasons) == 1 and v.reasons[0].startswith("guardrail " + name), v.reasons
    m = replace(m, canary=replace(ARM, text=profile(**inside)))
    assert judge_canary(m, EXACT).outcome == Outcome.RUNNING


@pytest.mark.parametrize("n, breached", [(30, False), (2000, True)])
def test_a_degeneracy_guardrail_breaches_only_beyond_sampling_noise(n, breached):
    # +0.08 repetition, 0.03 past the allowance: within noise over 30 answers a side (standard
    # error 0.026), eight standard errors over 2,000
    m = replace(BASE, stable=replace(ARM, text=profile(n=n, sd=0.1)),
                canary=replace(ARM, text=profile(n=n, repetition=0.23, sd=0.1)))
    assert (judge_canary(m, POLICY).outcome == Outcome.FAIL) is breached


def test_arms_without_answers_compare_no_degeneracy():
    assert judge_canary(replace(BASE, canary=replace(ARM, text=profile())), POLICY).outcome == Outcome.RUNNING


# -- one definition per setting ----------------------------------------------------------------

#: Policy field -> the ``[release]`` setting it is read from (the gate's carry a ``gate_`` prefix).
CANARY_FIELDS = {f: f for f in ("alpha", "min_events", "deadline_s", "error_limit", "max_error_rate_increase",
                                "max_latency_ratio", "max_length_ratio", "guardrail_z", "max_reject_share_increase",
                                "max_flag_rate_increase")}
GATE_FIELDS = {f: f"gate_{f}" for f in ("max_length_ratio", "max_kl", "min_entropy_ratio", "min_distinct_ratio",
                                        "max_score_drop", "min_trainer_entropy", "min_trainer_distinct")}
DEGENERACY_FIELDS = ("max_repetition_increase", "max_char_class_shift", "max_collapse_increase")


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
