"""The demo's canary cadence against the release budget: how many promotions a run can expect.

    python bench/demo_cadence.py [--runs 2000] [--seed 0] [--json PATH]

A run of ``flywheel demo`` has 210 s of traffic and room for a few canaries, and the release
controller tests the k-th canary of a deployment for PASS at a level that depends on k and on the
passes before it (release/budget.py ``pass_level``; the demo's deployment starts afresh each run).
This simulates whole runs the way the controller judges them, with the controller's own level
and e-process (release/sequential.py), and prints, for the demo's settings (``local/demo.toml``)
and the variants that were weighed against them, how many canaries a run holds, how many
promotions it can expect, and how many false ones when no version is better.

What is simulated, per run (seeded):

- **Traffic**: the demo's users (200, 8 requests/s, a tenth of them the abusive user, left out:
  reward flags it), each request from a user drawn uniformly. A user judges an answer of a
  version accepted with probability 0.85 x its accept rate (the rest: 0.85 rejected, 0.15
  silent), as local/simulate.py's users do.
- **Versions**: the first reaches the release gate ``FIRST_S`` into the traffic and a new one every
  ``EVERY_S`` (the demo's measured cadence: README, "What a run shows"). Accept rates by version:
  ``learning`` (0.25 at the start, 0.42 for v1, then rising to 0.7: what the demo's runs showed
  users accepting) or ``null`` (every version 0.25).
- **A canary** starts ``GATE_S`` after the newest version not yet tried is published and no
  canary runs. Each user seen before it started (``release.new_users = "exclude"``) is put on the
  canary arm with probability ``canary_share``. Their outcome is the first judgement they gave on
  an answer within ``outcome_window_s`` of their first answer in the canary (none: no accept),
  read ``outcome_window_s`` plus ingest's ``window_s`` and ``grace_s`` after that first answer, and
  paired in the order of first answers (release/outcomes.py). Every second: FAIL once each arm
  has ``min_events`` outcomes and the "worse" e-value passes 1/alpha; PASS at the budget's level;
  no verdict by ``deadline_s``: rolled back. A canary still running when traffic ends is
  undecided. The guardrails and the sample-ratio check are not simulated (they hold or roll back
  identical versions at most ``guardrail_alpha`` and ``srm_alpha`` of the time).

The outputs are expectations under this model, not measurements of the loop: the demo's five
seeds (bench/demo_seeds.py) are the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from release.budget import pass_level
from release.sequential import Pairing, log_e_better, log_e_worse

DURATION_S = 210.0
USERS = 200
RATE = 8.0 * 0.9  # requests a second from the cohort users (the abuser sends a tenth)
FEEDBACK = 0.85
FIRST_S = 45.0
EVERY_S = 50.0
GATE_S = 3.0
TICK_S = 1.0
ALPHA = 0.05
SCENARIOS = {
    "learning": (0.25, 0.42, 0.55, 0.62, 0.66, 0.68, 0.70),
    "null": (0.25,) * 7,
}


@dataclass(frozen=True)
class Cadence:
    """The settings a run's canaries depend on (``local/demo.toml``'s names)."""

    name: str
    outcome_window_s: float
    settle_s: float  # ingest.window_s + ingest.grace_s
    deadline_s: float
    min_events: int
    budget_canaries: int
    canary_share: float = 0.5

    @classmethod
    def of(cls, name: str, settings: Any) -> Cadence:
        r, i = settings.release, settings.ingest
        return cls(name, r.outcome_window_s, i.window_s + i.grace_s, r.deadline_s, r.min_events, r.budget_canaries,
                   r.canary_share)


def demo_cadence() -> Cadence:
    """The cadence ``local/demo.toml`` sets (what ``flywheel demo`` runs)."""
    from flywheel.settings import load_settings

    return Cadence.of("the demo's settings (local/demo.toml)", load_settings(env={}, config_file=ROOT / "local" / "demo.toml"))


def traffic(rng: random.Random) -> list[tuple[float, int]]:
    """(time, user) of every cohort user's request over a run."""
    out, t = [], 0.0
    while True:
        t += rng.expovariate(RATE)
        if t >= DURATION_S:
            return out
        out.append((t, rng.randrange(USERS)))


def canary_verdict(cfg: Cadence, reqs: list[tuple[float, int]], start: float, rates: tuple[float, float],
                   level: float, rng: random.Random) -> tuple[str, float]:
    """("pass" | "fail" | "rollback" | "undecided", when) for one canary started at ``start``,
    ``rates`` the (stable, canary) accept rates."""
    seen = {u for t, u in reqs if t < start}
    end = min(start + cfg.deadline_s, DURATION_S)
    arm = {u: rng.random() < cfg.canary_share for u in seen}
    first: dict[int, float] = {}
    signal: dict[int, bool | None] = {}
    for t, u in reqs:
        if t < start or t >= end or u not in seen:
            continue
        first.setdefault(u, t)
        if signal.get(u) is None and t <= first[u] + cfg.outcome_window_s:
            x = rng.random()
            p = rates[arm[u]]
            signal[u] = True if x < FEEDBACK * p else (False if x < FEEDBACK else None)
    order = sorted(first, key=first.get)
    reads = [(first[u] + cfg.outcome_window_s + cfg.settle_s, arm[u], bool(signal.get(u))) for u in order]
    pairing, counts, i = Pairing(), [0, 0], 0
    tau = start
    while tau < end:
        tau += TICK_S
        while i < len(reads) and reads[i][0] <= tau:
            _, canary, accepted = reads[i]
            pairing.add("canary" if canary else "stable", accepted)
            counts[canary] += 1
            i += 1
        if min(counts) >= cfg.min_events:
            if log_e_worse(pairing.count) >= math.log(1 / ALPHA):
                return "fail", tau
            if log_e_better(pairing.count) >= math.log(1 / level):
                return "pass", tau
    return ("rollback" if start + cfg.deadline_s <= DURATION_S else "undecided"), end


def one_run(cfg: Cadence, rates: tuple[float, ...], rng: random.Random) -> dict[str, Any]:
    reqs = traffic(rng)
    stable, tried, passes, t = 0, 0, [], 0.0
    first_promotion = None
    while True:
        published = [v for v in range(1, len(rates)) if FIRST_S + (v - 1) * EVERY_S <= t]
        newest = max(published, default=0)
        if newest <= tried:  # wait for the next version
            nxt = tried + 1
            if nxt >= len(rates):
                break
            t = FIRST_S + (nxt - 1) * EVERY_S
            continue
        start = t + GATE_S
        if start >= DURATION_S:
            break
        level = pass_level(ALPHA, cfg.budget_canaries, passes)
        verdict, t = canary_verdict(cfg, reqs, start, (rates[stable], rates[newest]), level, rng)
        tried = newest
        passes.append(verdict == "pass")
        if verdict == "pass":
            stable = newest
            first_promotion = first_promotion if first_promotion is not None else t
        if verdict == "undecided":
            break
    return {"canaries": len(passes), "promotions": sum(passes), "first_promotion_s": first_promotion}


#: What the demo's cadence was weighed against (each changes one or two of its settings).
VARIANTS = (
    # the demo's settings before issue 45, with the outcome windows' defaults laid over them
    ("production's outcome window (60 s), a 30 s join window, blocks of 20",
     {"outcome_window_s": 60.0, "settle_s": 31.0, "budget_canaries": 20}),
    ("a 30 s join window, blocks of 20", {"settle_s": 31.0, "budget_canaries": 20}),
    ("blocks of 20", {"budget_canaries": 20}),
    ("a 60 s deadline", {"deadline_s": 60.0}),
    ("a 75 s deadline", {"deadline_s": 75.0}),
    ("a 5 s outcome window, a 60 s deadline", {"outcome_window_s": 5.0, "deadline_s": 60.0}),
    ("a verdict from 10 outcomes an arm", {"min_events": 10}),
)


def cadences() -> list[Cadence]:
    demo = demo_cadence()
    return [demo] + [replace(demo, name=f"... with {name}", **change) for name, change in VARIANTS]


def measure(cfg: Cadence, runs: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {"cadence": asdict(cfg)}
    for scenario, rates in SCENARIOS.items():
        rng = random.Random(f"{seed}-{scenario}-{cfg.name}")
        got = [one_run(cfg, rates, rng) for _ in range(runs)]
        firsts = sorted(r["first_promotion_s"] for r in got if r["first_promotion_s"] is not None)
        out[scenario] = {
            "canaries": sum(r["canaries"] for r in got) / runs,
            "promotions": sum(r["promotions"] for r in got) / runs,
            "any_promotion": sum(r["promotions"] > 0 for r in got) / runs,
            "first_promotion_p50_s": firsts[len(firsts) // 2] if firsts else None,
        }
    return out


def table(rows: list[dict[str, Any]], runs: int) -> str:
    lines = [f"Expected per run of 210 s ({runs} simulated runs each; alpha {ALPHA}):", "",
             ("| cadence | canaries | promotions (learning) | runs with one | first promotion p50 (s) "
             "| false promotions (null) |"),
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lr, nl = r["learning"], r["null"]
        first = "-" if lr["first_promotion_p50_s"] is None else f"{lr['first_promotion_p50_s']:.0f}"
        lines.append(f"| {r['cadence']['name']} | {lr['canaries']:.2f} | {lr['promotions']:.2f} "
                     f"| {lr['any_promotion']:.2f} | {first} | {nl['promotions']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = [measure(c, args.runs, args.seed) for c in cadences()]
    print(table(rows, args.runs))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
