"""The demo's canary cadence against the release budget (bench/demo_cadence.py, README)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from demo_cadence import SCENARIOS, demo_cadence, one_run


def promotions(cadence, scenario: str, runs: int = 60) -> float:
    rng = random.Random(f"test-{scenario}")
    return sum(one_run(cadence, SCENARIOS[scenario], rng)["promotions"] for _ in range(runs)) / runs


def test_the_demos_canaries_can_promote_within_a_run():
    # local/demo.toml's cadence expects 0.9 promotions a run of 210 s when versions learn as the
    # demo's do (README: 0.92 over 2,000 simulated runs; 60 here, a standard error near 0.05).
    # Its canaries before (outcomes read after production's 60 s window and a 30 s join window,
    # past the 45 s deadline) could never pass: 0.0
    demo = demo_cadence()
    assert demo.budget_canaries == 4 and demo.outcome_window_s == 0.0
    assert promotions(demo, "learning") >= 0.65
    assert promotions(replace(demo, outcome_window_s=60.0, settle_s=31.0), "learning", runs=20) == 0.0
    assert promotions(demo, "null", runs=30) <= 0.05  # identical versions: a false promotion a run at most alpha
