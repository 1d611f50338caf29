"""Whether a real lift stays promotable over a deployment's life: the power of a canary's PASS at
the level the budget across canaries gives the k-th canary (release/budget.py ``pass_level``, the
controller's own function), k = 1, 10, 50, none of the canaries before it having passed (the
budget's worst case), against the level the budget gave before (e-LOND over the whole life,
gamma_k = 1 / (k (k + 1))). ``flywheel bench --only canary_budget`` runs it into the bench table.

Run: ``python bench/canary_budget.py [--runs 4000] [--seed 45] [--quick] [--json PATH]`` (about a
minute of one core; ``--quick``: a smoke run of a few seconds). Simulated outcomes only (seeded).

Sizes, one outcome per user, paired as the controller pairs them (release/sequential.py), the
e-process checked after every pair from ``min_events`` on, as the controller checks it after
every record:

- demo: 65 pairs, 0.20 against 0.40 (a doubled accept rate; the demo's 45 s canary, where the
  audit measured 0.41 at k = 1 under the old budget), ``min_events`` and ``budget_canaries``
  from local/demo.toml;
- production: 1,000 pairs, 0.30 against 0.40 (1,000 users per arm), the defaults.

Printed: per size and k, the level and the share of canaries that PASS under each budget. The
e-process is the module's own ``log_e_better``, evaluated through the least number of wins that
crosses the level for each number of losses (a boundary computed once per level).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from canary_stats import crossing_boundary

from flywheel.settings import ReleaseSettings, load_settings
from release.budget import pass_level

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "local" / "demo.toml"
KS = (1, 10, 50)


def old_level(alpha: float, k: int) -> float:
    """The budget before issue 45: e-LOND with gamma_k = 1 / (k (k + 1)) over the whole life."""
    return alpha / (k * (k + 1))


def boundary(level: float, losses_max: int) -> np.ndarray:
    """b[l]: the fewest canary wins at which the e-value for "better" reaches 1/level with l losses."""
    return crossing_boundary(level, losses_max)


def power(rng: np.random.Generator, level: float, pairs: int, p_stable: float, p_canary: float, min_events: int,
          runs: int) -> float:
    """The share of ``runs`` canaries of ``pairs`` pairs whose e-process reaches 1/level."""
    canary = rng.random((runs, pairs)) < p_canary
    stable = rng.random((runs, pairs)) < p_stable
    wins = np.cumsum(canary & ~stable, axis=1)
    losses = np.cumsum(stable & ~canary, axis=1)
    hit = wins >= boundary(level, pairs)[losses]
    hit[:, :min_events - 1] = False  # no verdict before min_events outcomes per arm
    return float(hit.any(axis=1).mean())


def sizes() -> list[tuple[str, int, float, float, int, int, float]]:
    """(label, pairs, stable rate, canary rate, min_events, budget_canaries, alpha) of each size."""
    demo = load_settings(env={}, config_file=DEMO_CONFIG).release
    prod = ReleaseSettings()
    return [("demo: 65 pairs, 0.20 -> 0.40", 65, 0.20, 0.40, demo.min_events, demo.budget_canaries, demo.alpha),
            ("production: 1,000 pairs, 0.30 -> 0.40", 1000, 0.30, 0.40, prod.min_events, prod.budget_canaries,
             prod.alpha)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4000, help="simulated canaries per size, k and budget")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few canaries")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.runs = 200
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    rows = []
    print(f"power of a canary's PASS by its index k, no pass before it, {args.runs:,} canaries a cell, seed {args.seed}")
    print(f"{'size':<40}{'block':>6}{'k':>4}{'level':>10}{'PASS':>7}{'old level':>11}{'old PASS':>9}")
    for label, pairs, p_stable, p_canary, min_events, block, alpha in sizes():
        for k in KS:
            level = pass_level(alpha, block, [False] * (k - 1))
            new = power(rng, level, pairs, p_stable, p_canary, min_events, args.runs)
            old = power(rng, old_level(alpha, k), pairs, p_stable, p_canary, min_events, args.runs)
            print(f"{label:<40}{block:>6}{k:>4}{level:>10.2e}{new:>7.3f}{old_level(alpha, k):>11.2e}{old:>9.3f}")
            se = math.sqrt(max(new * (1 - new), 1e-12) / args.runs)
            rows.append({"name": f"canary power by index, {label.split(':')[0]}, k={k}", "value": new,
                         "baseline": old, "unit": "share of canaries", "goal": None,
                         "note": (f"{label}, level {level:.2e} (blocks of {block}) against the old budget's "
                                  f"{old_level(alpha, k):.2e}; SE {se:.3f}")})
    print(f"\n{time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "quick": args.quick}, indent=1))


if __name__ == "__main__":
    main()
