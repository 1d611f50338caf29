"""bench/canary_fold.py, the harness the canary's false-PASS rate is measured with: its records are
the contract's own, its guards judge as reward's, and (slow) through it the controller's fold and
judge keep a false PASS under alpha in every scenario, while an invalid judge is caught.

Statistical reasoning of the slow test: with R runs per scenario the number of runs with a false
PASS is Binomial(R, q); a valid test has q <= alpha. The bound is alpha + 3 standard errors of a
rate at alpha, sqrt(alpha (1 - alpha) / R): a valid implementation exceeds it with probability
about 0.1%. The seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from flywheel.contracts import (
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from flywheel.settings import RewardSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    """A module of bench/ (a directory of scripts, not a package), loaded without touching sys.path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fold = _bench("canary_fold")


def test_episode_and_reward_records_are_the_contracts_own_encoding():
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24)
    for signal, route in (("accept", "canary"), ("ignore", "stable")):
        gen = GenerationEvent(generation_id="g7", group_id="g7", model_name="flywheel", model_version=3, user_id="u1",
                              endpoint="completions", created_at=100.0, completed_at=100.5, latency_ms=500.0,
                              prompt_text="p", prompt_token_ids=(1, 2), completion_text="c",
                              completion_token_ids=(5, 6, 7, 8), logprobs=(-1.0,) * 4, sampling=sampling,
                              finish_reason="stop", route=route)
        ep = EpisodeEvent(generation=gen, signal=signal, timed_out=signal == "ignore",
                          feedback_ids=() if signal == "ignore" else ("f-g7",), resolved_at=104.0)
        record = fold.episode_record("g7", 3, "u1", 100.0, 0.5, route, signal, 104.0)
        assert record == decode(EpisodeEvent, encode(ep)) and encode(record) == encode(ep)
    for flags in ((), ("constant_user",)):
        rw = RewardEvent(generation_id="g7", group_id="g7", user_id="u1", model_version=3, signal="reject",
                         prompt_token_ids=(1, 2), completion_token_ids=(5, 6, 7, 8), logprobs=(-1.0,) * 4,
                         sampling=sampling, reward=0.0, flags=flags, generated_at=100.0, labeled_at=105.0)
        record = fold.reward_record("g7", 3, "u1", "reject", flags, 100.0, 105.0)
        assert record == decode(RewardEvent, encode(rw)) and encode(record) == encode(rw)


def test_the_guards_flag_an_accept_everything_user_as_rewards_would():
    guards = fold.Guards(RewardSettings())  # constant_min_signals 20
    flags = [guards.judge("abuser", "accept") for _ in range(25)]
    assert flags[:19] == [()] * 19 and all("constant_user" in f for f in flags[19:])
    assert guards.judge("someone", "reject") == ()


def test_each_canary_of_a_run_draws_its_own_split():
    demo = load_settings(env={}, config_file=ROOT / "local" / "demo.toml")
    run = fold.Run(fold.demo_scenario(demo), 0, fold.e_process, fold.random.Random(1))
    verdicts = run.outcomes()
    salts = [salt for _, _, canary, salt, _ in run.routes if canary is not None]
    assert len(verdicts) >= 2 and len(set(salts)) == len(salts) >= len(verdicts)


@pytest.mark.parametrize("signal, late, every, sent_at", [
    ("accept", 20.0, 0.0, 12.0),  # accepts go at once
    ("reject", 0.0, 0.0, 12.0),
    ("reject", 20.0, 0.0, 32.0),  # late by 20 s
    ("reject", 0.0, 30.0, 30.0),  # held to the next burst
    ("reject", 20.0, 30.0, 60.0),  # late, then held
    ("accept", 0.0, 30.0, 12.0),
])
def test_a_reject_comes_late_and_in_bursts_as_the_scenario_says(signal, late, every, sent_at):
    sc = fold.Scenario("t", reject_late_s=late, reject_every_s=every)
    assert fold.signal_time(10.0, 2.0, signal, sc) == sent_at


def test_the_share_changes_once_the_canary_is_old_enough():
    sc = fold.Scenario("t", canary_share=0.1, share_to=0.5, share_at_s=45.0)
    assert [sc.share(age) for age in (0.0, 44.9, 45.0, 90.0)] == [0.1, 0.1, 0.5, 0.5]
    assert fold.Scenario("t", canary_share=0.2).share(1e9) == 0.2


V = fold.Verdict
O = fold.Outcome


@pytest.mark.parametrize("verdict, at_deadline, call", [
    (V(O.PASS, ("canary accepted more often",)), False, fold.Call.PASS),
    (V(O.FAIL, ("canary accepted less often",)), False, fold.Call.FAIL),
    (V(O.FAIL, ("guardrail share of rejects: 0.5 against 0.3",)), False, fold.Call.GUARDRAIL),
    (V(O.INCONCLUSIVE, ("no verdict after 90s",)), True, fold.Call.DEADLINE),
    (V(O.RUNNING), True, fold.Call.DEADLINE),
    (V(O.ERROR, ("3 measurements failed",)), False, fold.Call.HELD),
    (V(O.INCONCLUSIVE, ("held",)), False, fold.Call.HELD),
])
def test_what_ended_a_canary_is_told_apart(verdict, at_deadline, call):
    assert fold.call_of(verdict, at_deadline) == call


def _served(sc: fold.Scenario, seed: int = 3):
    """A run's answers: request -> (version, route, user, signal, rater), kept for every request."""
    run = fold.Run(sc, 0, fold.e_process, fold.random.Random(seed))
    kept = {}
    answer = run._answer

    def keep(i):
        at = answer(i)
        kept[i] = (run.reqs[i], *run.served[i])
        return at
    run._answer = keep
    run.outcomes()
    return run, kept


def test_puppets_that_see_their_arm_accept_only_the_canary_and_blind_ones_cannot_choose():
    seeing = fold.replace(fold.ADVERSARY_BASE, puppets=30, deadline_s=40.0)
    _, kept = _served(seeing)
    signals = [(route, signal) for r, _, route, _, signal, _ in kept.values() if r.who == fold.Who.PUPPET]
    assert {route for route, s in signals if s != "ignore"} == {"canary"}
    assert {s for route, s in signals if route == "stable"} == {"ignore"}
    _, kept = _served(fold.replace(seeing, puppets_see_arm=False))
    routes = {route for r, _, route, _, signal, _ in kept.values() if r.who == fold.Who.PUPPET and signal == "accept"}
    assert routes == {"canary", "stable"}


def test_the_requester_is_on_the_canary_and_feedback_under_other_ids_never_reaches_the_topic():
    # serving tags each answer with its user (serving/identity.py): feedback naming another user is
    # refused (or recorded and never counted), so none of the 60 raters' accepts becomes a signal
    run, kept = _served(fold.replace(fold.ADVERSARY_BASE, raters=60, deadline_s=60.0))
    mine = [(route, signal) for r, _, route, _, signal, _ in kept.values() if r.who == fold.Who.REQUESTER
            and r.t >= fold.ADVERSARY_BASE.warmup_s]
    assert len(mine) > 20 and set(mine) == {("canary", "ignore")}
    assert run.raters_used > 20  # each answer was accepted under another id, and refused
    request = run.reqs[0]
    assert not run._feedback_counts(request, "rater-0-1") and run._feedback_counts(request, run.requester[1])


def test_a_signal_sent_after_ingests_window_closed_is_no_episodes_signal():
    # rejects a minute late against a 30 s window: ingest dead-letters them as late feedback, and the
    # answer's episode leaves as unrated when its window closes
    _, kept = _served(fold.Scenario("t", window_s=30.0, reject_late_s=60.0, deadline_s=30.0))
    signals = {signal for r, *_, signal, _ in kept.values()}
    assert signals == {"accept", "ignore"}
    _, kept = _served(fold.Scenario("t", window_s=90.0, reject_late_s=60.0, deadline_s=30.0))
    assert {signal for r, *_, signal, _ in kept.values()} == {"accept", "reject", "ignore"}


def test_lagging_replicas_serve_the_old_routing_for_their_lag():
    sc = fold.replace(fold.ADVERSARY_BASE, replicas=4, lagging=2, lag_s=20.0, deadline_s=40.0)
    _, kept = _served(sc)
    start = sc.warmup_s
    early = [(r.replica, route) for r, _, route, _, _, _ in kept.values() if start <= r.t < start + 20.0]
    assert {route for replica, route in early if replica < 2} == {"stable"}
    assert {route for replica, route in early if replica >= 2} == {"stable", "canary"}


RUNS = 400
BOUND = 0.05 + 3 * math.sqrt(0.05 * 0.95 / RUNS)  # 0.083


@pytest.mark.slow
def test_a_false_pass_stays_under_alpha_in_every_scenario_and_an_invalid_judge_is_caught():
    # the rates at 1,000 runs a scenario (`python bench/canary_stats.py`) are in release/README.md
    demo = load_settings(env={}, config_file=ROOT / "local" / "demo.toml")
    scenarios = fold.scenarios(demo)
    assert {sc.alpha for sc in scenarios} == {0.05}
    rates = {sc.name: fold.measure(sc, RUNS, seed=11).rate for sc in scenarios}
    assert all(rate <= BOUND for rate in rates.values()), rates
    # the harness can fail: a fixed-horizon z-test asked as often goes far past the bound
    naive = fold.measure(scenarios[0], RUNS, seed=11, judge=fold.naive_z).rate
    assert naive > BOUND, naive
