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
    demo = load_settings(env={}, config_file=ROOT / "local" / "demo.toml").release
    run = fold.Run(fold.demo_scenario(demo), 0, fold.e_process, fold.random.Random(1))
    verdicts = run.outcomes()
    salts = [salt for _, _, canary, salt in run.routes if canary is not None]
    assert len(verdicts) >= 2 and len(set(salts)) == len(salts) >= len(verdicts)


RUNS = 400
BOUND = 0.05 + 3 * math.sqrt(0.05 * 0.95 / RUNS)  # 0.083


@pytest.mark.slow
def test_a_false_pass_stays_under_alpha_in_every_scenario_and_an_invalid_judge_is_caught():
    # the rates at 1,000 runs a scenario (`python bench/canary_stats.py`) are in release/README.md
    demo = load_settings(env={}, config_file=ROOT / "local" / "demo.toml").release
    scenarios = fold.scenarios(demo)
    assert {sc.alpha for sc in scenarios} == {0.05}
    rates = {sc.name: fold.measure(sc, RUNS, seed=11).rate for sc in scenarios}
    assert all(rate <= BOUND for rate in rates.values()), rates
    # the harness can fail: a fixed-horizon z-test asked as often goes far past the bound
    naive = fold.measure(scenarios[0], RUNS, seed=11, judge=fold.naive_z).rate
    assert naive > BOUND, naive
