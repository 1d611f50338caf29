"""bench/canary_stats.py's judging of its rows: a measured error rate against the level the
controller tested it at (pure), and the level each row shows is that one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    """A module of bench/ (a directory of scripts, not a package), loaded by file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name; canary_stats imports canary_fold
    spec.loader.exec_module(module)
    return module


fold = _bench("canary_fold")
stats = _bench("canary_stats")


@pytest.mark.parametrize("count, runs, level, within", [
    (0, 400, 0.025, "OK"),
    (10, 400, 0.025, "OK"),  # exactly the level
    (11, 400, 0.025, "noise"),
    (19, 400, 0.025, "noise"),  # 0.0475 <= 0.025 + 3 sqrt(0.025 * 0.975 / 400) = 0.0484
    (20, 400, 0.025, "over"),
    (33, 400, 0.05, "noise"),  # 0.0825 <= 0.0827
    (34, 400, 0.05, "over"),
    (2, 40, 0.025, "noise"),  # two runs in 40: within the spread of 40 runs
    (320, 400, 0.025, "over"),
])
def test_a_rate_is_over_its_level_only_past_the_spread_of_a_rate_at_the_level(count, runs, level, within):
    assert stats.within(count, runs, level) == within


def test_a_single_canary_row_shows_the_level_it_was_tested_at():
    # the first canary of a deployment is tested at the budget's first level, not at alpha
    r = fold.Rates(runs=400, passed=8, canaries=400, first_canary_passed=8, pass_level=0.025, fail_level=0.05)
    row = stats._null_row("i.i.d. users", fold.Scenario("i.i.d. users", alpha=0.05), r)
    assert row["baseline"] == 0.025
    several = stats._null_row("demo", fold.Scenario("demo", alpha=0.05, canaries=10), r)
    assert several["baseline"] == 0.05  # a run of canaries: one chance per canary, alpha over the run
