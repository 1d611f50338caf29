"""Whether a canary verdict can be trusted: its false-PASS rate and power through the controller's
own measurement and judge, what the always-valid test costs in events, and what watching does to
a classic test. ``flywheel bench --only canary`` runs it into the bench table.

Run: ``python bench/canary_stats.py [--fold-runs 1000] [--power-runs 100] [--adversary-runs 400]
[--runs 2000] [--null-runs 10000] [--null-pairs 10000] [--seed 20250101] [--quick] [--json PATH]``
(about 25 minutes of one core, (e) most of it; ``--quick``: a smoke run, one run a row of (e)).
Simulated users only (seeded): nothing is served, nothing is written.

(c) False PASS through the real fold (bench/canary_fold.py): two IDENTICAL versions, canaries of
    simulated users whose records (built through flywheel/contracts.py) go through serving's
    salted hash, reward's abuse guards, release/measure.py's Tally and release/judge.py's
    judge_canary, asked after every record that moved the counts, at the level the deployment's
    budget gives each canary. Scenarios: i.i.d. users; one abusive user sending 10% of requests
    and accepting everything (reward's guard window fresh as the canary starts: the worst case);
    late feedback; two tastes with unequal base rates among few, heavy-tailed users (the arms'
    tastes differ by chance); the demo's settings (local/demo.toml: canary after canary for
    210 s, each rolled back after 45 s without a verdict; a run's false PASS is any PASS in it).
    Printed per scenario: the share of runs with a false PASS, its standard error, and the level
    it is judged against: for one canary the level the budget gives it (the first canary of a
    deployment: release/budget.py), for a run of canaries alpha. Goal: at most that level. The same harness with a deliberately invalid judge (a
    fixed-horizon z-test asked as often) shows it can see an inflated rate.
(d) Power through the same fold: the canary's users accept 0.40 where stable's accept 0.30; the
    share of canaries that PASS by their deadline, at the size stated.
(e) Who and what could steer a verdict (issue 45), through the same routing (under the routing
    secret), guards, fold and judge, two IDENTICAL versions, one canary of 150 s after a minute of
    traffic: rejects held and sent in bursts every 30 s (canary share 0.5 and 0.1); rejects 5, 20
    and 60 s late while accepts come at once; 30 sock puppets (ids first seen in the canary) that
    accept only canary answers, knowing their arm, or guessing it as a hidden version leaves them;
    one canary-side requester whose answers are accepted under 60 other users' ids (feedback goes
    through serving's owner check: refused feedback never reaches the topic); few heavy users of
    two tastes; the share raised from 0.1 to 0.5 half way; 2 of 4 serving replicas applying the
    routing 20 s late; the accept rate drifting from 0.15 to 0.45 (time of day). Printed per row:
    the share of runs with a false PASS against the level the controller tested it at, the runs
    rolled back by the accept-rate test (FAIL) and by a guardrail against FAIL's level, and the
    runs held (a sample-ratio mismatch). Verdict: OK at most the level, ``noise`` above it by
    less than 3 standard errors of a rate at the level, ``over`` past that.
(a)-(b) below use numpy alone, on i.i.d. outcomes already paired (a pair is one outcome of each
    arm: with a 10% canary share, pairs grow as the canary's outcomes do).

(a) Pairs until a verdict. Canary and stable users accept at the given rates; after every pair
    the discordant-pair e-process of release/sequential.py is checked, as the controller does,
    until it says PASS or FAIL or the cap is reached. Printed: the median and 90th percentile of
    the pairs it needed, against the sample size per arm a fixed-horizon one-sided two-proportion
    z-test needs for the same power (the share of runs the sequential test passed by its cap),
    from the normal approximation:
    n = (z_{1-alpha} sqrt(2 pbar qbar) + z_{power} sqrt(p1 q1 + p2 q2))^2 / (p2 - p1)^2.
    That z-test's power at n is also simulated, as a check on the approximation.
(b) False alarms under continuous monitoring: equal rates (0.30 vs 0.30), checked after every pair
    from the 50th (the judge's ``min_events``) to the last. The e-process against the same z-test
    at the same alpha, both one-sided ("canary better": a false PASS) and both ways (any verdict;
    the judge runs both one-sided tests, each at alpha, so nominally 2 alpha). The z-test checked
    once at the last pair is the reference: it holds its nominal rate.

The e-process is evaluated with the module's own ``log_e_better``: it grows with the canary's wins
W and falls with its losses L, so a run crosses 1/alpha exactly when its (W, L) path reaches the
least W that crosses for its L, a boundary computed once per run length.

Rows read ``label  count  ratio ...``; the ratio is against the fixed-horizon z-test's sample
size in (a) and against the nominal false-alarm rate in (b).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from statistics import NormalDist

import canary_fold as fold
import numpy as np

from flywheel.settings import load_settings
from release.sequential import PairCount, log_e_better

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "local" / "demo.toml"

STABLE_RATE = 0.30
MIN_EVENTS = 50  # the judge's default: no verdict before 50 outcomes per arm
_N = NormalDist()


def crossing_boundary(alpha: float, losses_max: int) -> np.ndarray:
    """b[l]: the fewest canary wins at which ``log_e_better`` reaches log(1/alpha) with l losses
    (``log_e_worse`` mirrors it: losses >= b[wins])."""
    threshold = math.log(1 / alpha)
    b = np.empty(losses_max + 1, dtype=np.int64)
    w = 0
    for losses in range(losses_max + 1):  # nondecreasing in l: carry w over
        while log_e_better(PairCount(0, w, losses)) < threshold:
            w += 1
        b[losses] = w
    return b


def outcomes(rng: np.random.Generator, runs: int, pairs: int, p_canary: float, p_stable: float):
    return rng.random((runs, pairs)) < p_canary, rng.random((runs, pairs)) < p_stable


def first_index(hit: np.ndarray) -> np.ndarray:
    """Per row, the 1-based index of the first True, or a huge number when there is none."""
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, np.iinfo(np.int64).max)


def fixed_horizon_n(p1: float, p2: float, alpha: float, power: float) -> int:
    """Per-arm sample size of the one-sided two-proportion z-test (normal approximation)."""
    pbar = (p1 + p2) / 2
    num = _N.inv_cdf(1 - alpha) * math.sqrt(2 * pbar * (1 - pbar)) + _N.inv_cdf(power) * math.sqrt(
        p1 * (1 - p1) + p2 * (1 - p2))
    return math.ceil((num / (p2 - p1)) ** 2)


def z_scores(canary: np.ndarray, stable: np.ndarray) -> np.ndarray:
    """The pooled two-proportion z after each pair (NaN while every outcome so far is the same)."""
    n = np.arange(1, canary.shape[1] + 1)
    pc, ps = np.cumsum(canary, axis=1) / n, np.cumsum(stable, axis=1) / n
    pooled = (pc + ps) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        return (pc - ps) / np.sqrt(pooled * (1 - pooled) * 2 / n)


def pairs_to_verdict(rng: np.random.Generator, p_canary: float, runs: int, cap: int, alpha: float) -> None:
    canary, stable = outcomes(rng, runs, cap, p_canary, STABLE_RATE)
    wins, losses = np.cumsum(canary & ~stable, axis=1), np.cumsum(stable & ~canary, axis=1)
    b = crossing_boundary(alpha, cap)
    passed, failed = first_index(wins >= b[losses]), first_index(losses >= b[wins])
    stop = np.minimum(passed, failed)
    power = float(np.mean(passed < failed))  # PASS first, by the cap
    wrong = int(np.sum(failed < passed))
    # a power of 1 has no finite fixed-horizon size: use the largest the run count can resolve
    target = min(power, 1 - 0.5 / runs)
    n_fixed = fixed_horizon_n(STABLE_RATE, p_canary, alpha, target)
    k_c, k_s = rng.binomial(n_fixed, p_canary, runs), rng.binomial(n_fixed, STABLE_RATE, runs)
    pooled = (k_c + k_s) / (2 * n_fixed)
    z = (k_c - k_s) / n_fixed / np.sqrt(pooled * (1 - pooled) * 2 / n_fixed)
    z_power = float(np.mean(z >= _N.inv_cdf(1 - alpha)))
    rates = f"{STABLE_RATE:.2f} vs {p_canary:.2f}"

    def row(label: str, pairs: float) -> None:
        shown = f"{pairs:,.0f}" if pairs <= cap else f">{cap:,}"
        print(f"{rates:<14}{label:<52}{shown:>8}{pairs / n_fixed:>9.2f}")

    row(f"fixed-horizon z-test, power {target:.3f} (sim {z_power:.3f})", n_fixed)
    row("always-valid e-process, mean (cap if none)", float(np.mean(np.minimum(stop, cap))))
    row("always-valid e-process, median", float(np.median(stop)))
    row("always-valid e-process, 90th percentile", float(np.percentile(stop, 90, method="higher")))
    row(f"always-valid e-process, cap (PASS by it {power:.3f})", cap)
    if wrong:
        print(f"{'':<14}(wrong-way FAIL first in {wrong} of {runs} runs)")


def false_alarms(rng: np.random.Generator, runs: int, pairs: int, alpha: float) -> None:
    b = crossing_boundary(alpha, pairs)
    z_one = _N.inv_cdf(1 - alpha)
    counts = dict.fromkeys(("e_pass", "e_any", "z_pass", "z_any", "z_once"), 0)
    chunk = max(1, 2_000_000 // pairs)  # bounded memory whatever the run length
    for start in range(0, runs, chunk):
        canary, stable = outcomes(rng, min(chunk, runs - start), pairs, STABLE_RATE, STABLE_RATE)
        wins, losses = np.cumsum(canary & ~stable, axis=1), np.cumsum(stable & ~canary, axis=1)
        e_pass = (wins >= b[losses])[:, MIN_EVENTS - 1:].any(axis=1)
        e_fail = (losses >= b[wins])[:, MIN_EVENTS - 1:].any(axis=1)
        z = z_scores(canary, stable)[:, MIN_EVENTS - 1:]
        z_pass, z_fail = (z >= z_one).any(axis=1), (z <= -z_one).any(axis=1)
        counts["e_pass"] += int(e_pass.sum())
        counts["e_any"] += int((e_pass | e_fail).sum())
        counts["z_pass"] += int(z_pass.sum())
        counts["z_any"] += int((z_pass | z_fail).sum())
        counts["z_once"] += int((z[:, -1] >= z_one).sum())
    for label, key, nominal in [
        ("always-valid e-process, every pair: false PASS", "e_pass", alpha),
        ("always-valid e-process, every pair: any verdict", "e_any", 2 * alpha),
        ("z-test, every pair: false PASS", "z_pass", alpha),
        ("z-test, every pair: any verdict", "z_any", 2 * alpha),
        ("z-test, once at the last pair: false PASS", "z_once", alpha),
    ]:
        rate = counts[key] / runs
        print(f"{label:<50}{counts[key]:>9,}{rate / nominal:>10.2f}{rate:>8.3f}{nominal:>9.2f}")


def false_passes(runs: int, seed: int) -> list[dict]:
    """(c): a row per scenario, and the naive judge's row."""
    demo = load_settings(env={}, config_file=DEMO_CONFIG)
    rows = []
    print(f"{'scenario (identical versions)':<62}{'runs':>6}{'false PASS':>11}{'SE':>7}{'level':>7}"
          f"{'pairs':>7}{'left out':>9}")
    for sc in fold.scenarios(demo):
        rows.append(_null_row(sc.name, sc, fold.measure(sc, runs, seed)))
    no_budget = replace(fold.demo_scenario(demo), budget=False)
    rows.append(_null_row("the demo's settings, each canary at alpha (no budget)", no_budget,
                          fold.measure(no_budget, runs, seed), goal=False))
    iid = fold.scenarios(demo)[0]
    rows.append(_null_row("i.i.d. users, a fixed-horizon z-test asked as often (invalid)", iid,
                          fold.measure(iid, runs, seed, fold.naive_z), goal=False))
    return rows


def _null_row(label: str, sc: fold.Scenario, r: fold.Rates, goal: bool = True) -> dict:
    # one canary is tested at the level the budget gives it, and judged against that level; a run
    # of several has one chance of a false PASS per canary, bounded by alpha over the run
    level = r.pass_level if sc.canaries == 1 else sc.alpha
    print(f"{label:<62}{r.runs:>6}{r.rate:>11.4f}{r.se:>7.4f}{level:>7.4f}{r.pairs:>7.0f}{r.excluded_users:>9.2f}")
    per = f", {r.canaries / r.runs:.1f} canaries a run" if sc.canaries > 1 else ""
    return {"name": f"canary false PASS: {label}", "value": r.rate, "baseline": level, "se": r.se,
            "unit": "share of runs", "goal": goal,
            "note": f"{r.runs} runs, SE {r.se:.4f}, {r.pairs:.0f} pairs at the verdict{per}"}


#: (label, scenario) of the power rows: 0.30 against 0.40
#: (no traffic before the canary is simulated: its users are counted as the established ones)
POWER = (
    ("half the users on the canary, 2,000 users, 20 requests/s, 5 min",
     fold.Scenario("power", users=2000, rate=20.0, deadline_s=300.0, min_events=50, lift=0.10, tick_s=1.0,
                   new_users="count")),
    ("10% of users on the canary, 6,000 users, 40 requests/s, 10 min",
     fold.Scenario("power", users=6000, rate=40.0, deadline_s=600.0, canary_share=0.1, min_events=50, lift=0.10,
                   tick_s=1.0, new_users="count")),
)


class Within(StrEnum):
    """A measured error rate against the level it is tested at."""

    OK = "OK"  # at most the level
    NOISE = "noise"  # above it, by less than 3 standard errors of a rate at the level: can be chance
    OVER = "over"  # above it by more: a valid test gets here in about 0.1-0.5% of rows


def within(count: int, runs: int, level: float) -> Within:
    """``count`` errors in ``runs`` against ``level``. The allowance is the spread a rate exactly at
    the level has over ``runs`` (binomial), so a row of few runs is never called over on noise."""
    rate = count / runs
    if rate <= level:
        return Within.OK
    return Within.NOISE if rate <= level + 3 * math.sqrt(level * (1 - level) / runs) else Within.OVER


def adversary_table(runs: int, seed: int) -> list[dict]:
    """(e): each adversary or condition of canary_fold.adversary_scenarios, between identical
    versions: false PASS against the level the budget gives the canary, false rollbacks (the
    accept-rate FAIL and the guardrails) against FAIL's level."""
    rows = []
    print(f"{'scenario (identical versions, one canary)':<62}{'runs':>5}{'false PASS':>11}{'SE':>7}{'level':>8}"
          f"{'FAIL':>6}{'guard':>6}{'level':>6}{'held':>6}  verdict")
    for sc in fold.adversary_scenarios():
        r = fold.measure(sc, runs, seed)
        rollbacks = r.failed + r.guardrail
        calls = within(r.passed, r.runs, r.pass_level), within(rollbacks, r.runs, r.fail_level)
        verdict = max(calls, key=list(Within).index)
        print(f"{sc.name:<62}{r.runs:>5}{r.rate:>11.3f}{r.se:>7.3f}{r.pass_level:>8.4f}{r.failed:>6}"
              f"{r.guardrail:>6}{r.fail_level:>6.2f}{r.held:>6}  {verdict}")
        note = (f"{r.runs} runs, SE {r.se:.4f}, {r.held} held; {r.pairs:.0f} pairs at the verdict; "
                f"{calls[0]} against its level")
        rows.append({"name": f"canary false PASS: {sc.name}", "value": r.rate, "baseline": r.pass_level,
                     "se": r.se, "unit": "share of runs", "goal": True, "within": str(calls[0]), "note": note})
        rows.append({"name": f"canary false rollback: {sc.name}", "value": rollbacks / r.runs,
                     "baseline": r.fail_level, "se": fold.share_se(rollbacks / r.runs, r.runs),
                     "unit": "share of runs", "goal": True, "within": str(calls[1]),
                     "note": f"{r.failed} by the accept rate, {r.guardrail} by a guardrail; {calls[1]} against its level"})
    return rows


def power(runs: int, seed: int) -> list[dict]:
    """(d): the share of canaries that PASS, the first of their deployment (at alpha/2)."""
    rows = []
    print(f"{'0.30 against 0.40':<62}{'runs':>6}{'PASS':>11}{'SE':>7}{'pairs':>14}")
    for label, sc in POWER:
        r = fold.measure(sc, runs, seed)
        print(f"{label:<62}{r.runs:>6}{r.rate:>11.3f}{r.se:>7.3f}{r.pairs:>14.0f}")
        rows.append({"name": f"canary power at 0.30 -> 0.40: {label}", "value": r.rate, "se": r.se,
                     "unit": "share of canaries", "note": f"{r.runs} runs, {r.pairs:.0f} pairs at the verdict"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated canaries per lift in (a)")
    ap.add_argument("--null-runs", type=int, default=10_000, help="simulated canaries in (b)")
    ap.add_argument("--null-pairs", type=int, default=10_000, help="pairs each canary in (b) is watched for")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--fold-runs", type=int, default=1000, help="simulated runs per scenario in (c)")
    ap.add_argument("--power-runs", type=int, default=100, help="simulated canaries per size in (d)")
    ap.add_argument("--adversary-runs", type=int, default=400, help="simulated canaries per row of (e)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few runs, short canaries")
    ap.add_argument("--json", type=Path, default=None, help="also write (c) and (d)'s rows here")
    args = ap.parse_args()
    if args.quick:
        # (c) and (d) fold every record through the controller's tally and judge: a few runs each
        args.runs, args.null_runs, args.null_pairs, args.fold_runs, args.power_runs = 100, 300, 1000, 20, 1
        args.adversary_runs = 1
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()

    print(f"(c) false PASS through the real fold and judge, alpha from local/demo.toml and the defaults, seed "
          f"{args.seed}")
    rows = false_passes(args.fold_runs, args.seed)
    print()
    print("(d) power through the real fold and judge")
    rows += power(args.power_runs, args.seed)
    print()
    print(f"(e) adversaries and conditions through the real routing, guards, fold and judge, seed {args.seed}")
    rows += adversary_table(args.adversary_runs, args.seed)
    print()

    print(f"(a) pairs until a verdict, one-sided alpha {args.alpha}, {args.runs:,} runs per lift, seed {args.seed}")
    print(f"{'rates':<14}{'test':<52}{'pairs':>8}{'x fixed':>9}")
    for p_canary, cap in ((0.36, 3000), (0.40, 1500)):
        pairs_to_verdict(rng, p_canary, args.runs, cap, args.alpha)
    print()
    print(f"(b) false alarms at equal rates ({STABLE_RATE:.2f} vs {STABLE_RATE:.2f}), {args.null_runs:,} runs, "
          f"checked after every pair from the {MIN_EVENTS}th to the {args.null_pairs:,}th")
    print(f"{'test':<50}{'flagged':>9}{'x nominal':>10}{'rate':>8}{'nominal':>9}")
    false_alarms(rng, args.null_runs, args.null_pairs, args.alpha)
    print(f"\n{time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "quick": args.quick}, indent=1))


if __name__ == "__main__":
    main()
