"""What a run of the whole loop showed: accept rate over time by version, every release decision,
latency, how long feedback took to reach users as a better model, and each version's quality
score, the simulator's measure apart from any cohort's taste (``flywheel demo``).

The numbers come from three records a run leaves, all read after the fact:

- the simulated users' requests (``flywheel simulate``'s rows: when, which version answered, the
  user's judgement and when it was sent);
- the release controller's audit log (every state change with its actor and reason);
- the checkpoint store's versions (when each was published, which generations it trained on:
  ``ledger.json``; the trainer's metrics: per-token entropy, share of distinct completions).

:func:`summarise` is pure (table-tested in tests/unit/test_report.py); :func:`write_png` and
:func:`write_html` render its result.

**Answers** (a real model's run): what the stable version answered a few fixed prompts at the
start and after each promotion, greedily, sampled offline from each version's checkpoint
(local/taste.py's ``greedy_answers``), beside that version's accept rate as users met it
(:func:`answer_timeline`); the newest version too when it was never promoted.

**Feedback to canary**, and each stage's share of it. A judged answer's generation id is in the ledger of exactly one version,
the one trained on it. Its feedback reached users as a better model when the first version at or
after that one went live as a canary (or was promoted). ``feedback_to_checkpoint`` ends when that
ledger's version was published; ``checkpoint_to_canary`` runs from a version's publication to its
canary start, for every version canaried. The stages' Parquet archives (episodes, rewards) split
feedback-to-checkpoint into ingest (feedback sent to its episode emitted), reward (episode to
reward) and trainer (reward to the version holding it published: batching, steps, publishing).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.evidence import lift_z, user_outcomes
from local.simulate import PREFERENCES, quality

#: The demo's goals. Learning: over the last HOLD_S of traffic, the accept rate of the versions
#: that stayed live is at least twice the start rate (a mean held to the end, not the first
#: window that touched 2x: that was a peak, and it counted canaries rolled back later).
HOLD_S = 60.0
MIN_ENTROPY_SHARE = 0.5
MIN_DISTINCT = 0.95
#: The second learning goal, the one a run too short to hold a doubling can meet: the last version
#: that went live and stayed was accepted by more of its canary's users than the stable arm's over
#: the same seconds, by this many standard errors of the difference (one outcome per user, as the
#: controller counts; one-sided p 0.0013: sampling noise explains it about once in 740 runs).
#: Judged against the concurrent stable arm, not against the traffic before it: accept rates that
#: drift over a run would otherwise read as a lift (local/evidence.py).
LIFT_Z = 3.0
#: The third, measured offline (local/taste.py): the newest version's answers, sampled from its
#: checkpoint and judged by the simulated users, accepted more often than the starting model's,
#: prompt by prompt (32 batches of 32 answers over 24 prompts, the same draws: identical weights score z 0), by a
#: t over prompts whose one-sided p is a normal z's of 4 (p 3.2e-5; local/evidence.py).
TASTE_Z = 4.0
#: Accept rates are plotted over windows this long; the start is the first of them.
WINDOW_S = 30.0
#: A window's accept rate counts once it holds this many judgements.
MIN_JUDGED = 20
#: Release states that put a version in front of users.
LIVE_STATES = ("canary", "promoted")
#: Release states in which a version serves its canary's share of users (release/states.py's LIVE).
CANARY_STATES = ("canary", "awaiting_approval", "held")
#: A version that reached one of these failed its trial: its traffic is no evidence of what users
#: kept, so the learning goals leave it out.
FALLEN_STATES = ("rolled_back", "rejected")


@dataclass(frozen=True)
class Version:
    version: int
    created_at: float
    step: int
    samples: int
    trained: frozenset[str] = frozenset()
    metrics: dict[str, float] = field(default_factory=dict)


def read_versions(store: Path) -> dict[int, Version]:
    """Every version in a local checkpoint store: its manifest and ledger (unreadable ones skipped:
    a version being written as the run stopped)."""
    out = {}
    for d in sorted(store.glob("v[0-9]*")):
        try:
            man = json.loads((d / "flywheel-manifest.json").read_text())
            ledger = json.loads((d / "ledger.json").read_text()) if (d / "ledger.json").exists() else {}
        except (OSError, ValueError):
            continue
        v = int(man["version"])
        out[v] = Version(v, float(man["created_at"]), int(man.get("step", 0)), int(man.get("samples", 0)),
                         frozenset(ledger.get("trained", ())), dict(man.get("metrics", {})))
    return out


def _judged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cohort users' judgements (the abuser's accept-everything is no measure of the model)."""
    return [r for r in rows if r.get("status") == 200 and r.get("signal") and r.get("cohort") != "abuser"]


def _rate(rows: list[dict[str, Any]]) -> float | None:
    return sum(r["signal"] == "accept" for r in rows) / len(rows) if rows else None


def accept_windows(rows: list[dict[str, Any]], start: float, end: float, window_s: float = WINDOW_S,
                   step_s: float = 5.0) -> list[tuple[float, float | None, int]]:
    """(window end, seconds after ``start``; accept rate over the window or None under
    :data:`MIN_JUDGED`; judgements) for windows ending every ``step_s``."""
    judged = _judged(rows)
    out = []
    t = window_s
    while start + t <= end + 1e-9:
        inside = [r for r in judged if start + t - window_s <= r["at"] < start + t]
        out.append((t, _rate(inside) if len(inside) >= MIN_JUDGED else None, len(inside)))
        t += step_s
    return out


def _before_first_live(rows: list[dict[str, Any]], started_at: float, first_live: float | None) -> list[dict[str, Any]]:
    """Every judgement before the first trained version went live (all answered by the starting
    model), when that is at least a full window holding :data:`MIN_JUDGED`; else none."""
    if first_live is None or first_live - started_at < WINDOW_S:
        return []
    before = [r for r in _judged(rows) if r["at"] < first_live]
    return before if len(before) >= MIN_JUDGED else []


def start_rate(rows: list[dict[str, Any]], started_at: float, first_live: float | None,
               windows: list[tuple[float, float | None, int]]) -> float | None:
    """The accept rate users started from: every judgement before the first trained version went
    live, when that is at least a full window; else the first window's rate. A mean over the
    whole stretch, not one window: the one that happened to be lowest
    would make doubling easiest."""
    before = _before_first_live(rows, started_at, first_live)
    if before:
        return _rate(before)
    rated = [r for _, r, _ in windows if r is not None]
    return rated[0] if rated else None


def held_from(windows: list[tuple[float, float | None, int]], start: float | None) -> float | None:
    """Seconds of traffic until the accept rate reached twice ``start`` and stayed there: the end
    of the first window from which every later one is at 2x (None: the last one is not). A window
    without a rate breaks the hold: too few judgements are no evidence that it held."""
    if not start:
        return None  # twice nothing is no doubling
    since = None
    for t, r, _ in windows:
        since = (since if since is not None else t) if r is not None and r >= 2 * start else None
    return since


def fallen(audit: list[dict[str, Any]]) -> frozenset[int]:
    """Versions rolled back or rejected at any time in the run (a canary still undecided when
    traffic ended is not among them: it was live to the end)."""
    return frozenset(int(e["version"]) for e in audit
                     if e.get("to_state") in FALLEN_STATES and e.get("version") is not None)


def kept(rows: list[dict[str, Any]], gone: frozenset[int]) -> list[dict[str, Any]]:
    """The requests answered by versions that stayed live."""
    return [r for r in rows if r.get("version") not in gone]


def held_rate(rows: list[dict[str, Any]], started_at: float, ended_at: float,
              hold_s: float = HOLD_S) -> tuple[float | None, int]:
    """Accept rate over the last ``hold_s`` of traffic and its judgements (None: a run shorter than
    ``hold_s``, whose last stretch would include the start, or under :data:`MIN_JUDGED`)."""
    inside = [r for r in _judged(rows) if ended_at - hold_s <= r["at"] < ended_at]
    if ended_at - started_at < hold_s or len(inside) < MIN_JUDGED:
        return None, len(inside)
    return _rate(inside), len(inside)


@dataclass(frozen=True)
class Canary:
    """A version's canary: from when it went to canary until it left that state (promoted, rolled
    back, ...; None: still a canary when the audit was read), against ``stable``, the version
    stable meanwhile."""

    version: int
    start: float
    end: float | None
    stable: int


def canaries(audit: list[dict[str, Any]]) -> list[Canary]:
    """Every canary of the audit log, in the order they started."""
    out, stable, current = [], 0, None
    for e in sorted(audit, key=lambda e: e["at"]):
        v, to = e.get("version"), e.get("to_state")
        if v is None:
            continue
        if current is not None and int(v) == current.version and to not in CANARY_STATES:
            out.append(Canary(current.version, current.start, float(e["at"]), current.stable))
            current = None
        if to == "canary":
            if current is not None:  # a newer canary replaced it: it ended there
                out.append(Canary(current.version, current.start, float(e["at"]), current.stable))
            current = Canary(int(v), float(e["at"]), None, stable)
        elif to == "promoted":
            stable = int(v)
    return out + ([current] if current is not None else [])


def arm_outcomes(rows: list[dict[str, Any]], canary: Canary) -> tuple[tuple[int, int], tuple[int, int]]:
    """(stable arm, canary arm) over the canary's own seconds: one outcome per user
    (local/evidence.py's ``user_outcomes``), from the answers each arm's version gave then."""
    inside = [r for r in _judged(rows) if canary.start <= r["at"] and (canary.end is None or r["at"] < canary.end)]
    return (user_outcomes([r for r in inside if r.get("version") == canary.stable]),
            user_outcomes([r for r in inside if r.get("version") == canary.version]))


def last_live(rows: list[dict[str, Any]], audit: list[dict[str, Any]], gone: frozenset[int]) -> dict[str, Any]:
    """The trained version that went live last and stayed, among those whose canary had
    :data:`MIN_JUDGED` users judging on each arm (one canaried in the run's last seconds is no
    evidence either way), against the stable arm over the same seconds: one outcome per user on
    each side, as the controller counts them. A version promoted without a canary has no
    concurrent arm to compare with, and traffic before or after a canary is never the comparison:
    accept rates drift over a run (local/evidence.py)."""
    measured = []
    for c in canaries(audit):
        if c.version > 0 and c.version not in gone:
            stable, canary = arm_outcomes(rows, c)
            if min(stable[1], canary[1]) >= MIN_JUDGED:
                measured.append((c, stable, canary))
    if not measured:
        return {"version": None, "stable_version": None, "accept_rate": None, "users": 0, "stable_rate": None,
                "stable_users": 0, "z": None}
    c, stable, canary = max(measured, key=lambda m: m[0].start)
    return {"version": c.version, "stable_version": c.stable, "accept_rate": canary[0] / canary[1],
            "users": canary[1], "stable_rate": stable[0] / stable[1], "stable_users": stable[1],
            "canary_s": (c.end if c.end is not None else max(r["at"] for r in rows)) - c.start,
            "z": lift_z(stable, canary)}


def live_times(audit: list[dict[str, Any]]) -> dict[int, float]:
    """When each version first went in front of users (canary, or promoted without one)."""
    out: dict[int, float] = {}
    for e in sorted(audit, key=lambda e: e["at"]):
        if e.get("to_state") in LIVE_STATES and e.get("version") is not None:
            out.setdefault(int(e["version"]), float(e["at"]))
    return out


def decisions(audit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The audit log without the bookkeeping (a version announced, an older one superseded)."""
    keep = []
    for e in sorted(audit, key=lambda e: e["at"]):
        if e.get("to_state") in (None, "candidate", "superseded", "gating"):
            continue
        keep.append({"at": e["at"], "version": e.get("version"), "from": e.get("from_state"),
                     "to": e.get("to_state"), "actor": e.get("actor"), "reason": e.get("reason", "")})
    return keep


def held_out(audit: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """Each gated version's held-out eval scores (release/evals.py), read from its gate's record in
    the audit log, and the start's (v0's, stable's side of a gate while v0 was stable): version ->
    "<eval> (<way>)" -> its score, right and wrong answers and questions. Scores are greedy or
    likelihoods, the same whenever a version is asked, so versions gated at different times compare."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for e in sorted(audit, key=lambda e: e["at"]):
        gate = (e.get("evidence") or {}).get("gate")
        if not isinstance(gate, dict) or e.get("to_state") not in ("canary", "rejected"):
            continue
        record = gate.get("measurement") or gate
        if "stable_version" not in record:
            continue  # a gate recorded before it named its stable: whose scores these are is unknown
        for ev in record.get("evals") or []:
            n, name = ev["items"], f"{ev['name']} ({ev['method']})"
            for v, side in ((int(e["version"]), "candidate"), (int(record["stable_version"]), "stable")):
                right, wrong = ev[f"{side}_right"], ev[f"{side}_wrong"]
                out.setdefault(v, {})[name] = {"score": (right + (n - right - wrong) / 2) / n, "right": right,
                                               "wrong": wrong, "items": n}
    return out


def held_out_kept(scores: dict[int, dict[str, dict[str, Any]]], end: int, margin: float) -> bool:
    """Whether the version stable at the end scores, on every held-out eval and way, no less than
    the start less ``margin`` (the gate's non-inferiority margin): v0 itself always does; a
    version whose scores are unknown (no gate recorded them) does not."""
    if end == 0:
        return True
    start, last = scores.get(0, {}), scores.get(end, {})
    return bool(last) and all(k in last and last[k]["score"] >= s["score"] - margin for k, s in start.items())


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile: a value that occurred, at or above a share ``q`` of them."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50": _pct(xs, 0.5), "p95": _pct(xs, 0.95)}


def read_stage_times(archive: Path) -> dict[str, tuple[float, float]]:
    """generation id -> (episode resolved by ingest, reward labeled), from the stages' Parquet
    archives (empty when there are none)."""
    import pandas as pd

    try:
        eps = pd.read_parquet(archive / "episodes", columns=["generation_id", "resolved_at"])
        rws = pd.read_parquet(archive / "rewards", columns=["generation_id", "labeled_at"])
    except (OSError, ValueError):
        return {}
    both = eps.drop_duplicates("generation_id").merge(rws.drop_duplicates("generation_id"), on="generation_id")
    return {g: (float(a), float(b)) for g, a, b in both.itertuples(index=False)}


def latencies(rows: list[dict[str, Any]], versions: dict[int, Version], live: dict[int, float],
              stage_times: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """Feedback to checkpoint, checkpoint to canary and feedback to canary (seconds; module
    docstring); with the archives' times, feedback to checkpoint split by stage: ingest (feedback
    sent to episode emitted), reward (to reward labeled), trainer (to the version holding it
    published)."""
    owner = {gid: v.version for v in versions.values() for gid in v.trained}
    to_ckpt, to_live, ingest, reward, trainer = [], [], [], [], []
    for r in rows:
        gid = r.get("generation_id") or ""
        v = owner.get(gid)
        if v is None or r.get("feedback_at") is None:
            continue
        to_ckpt.append(versions[v].created_at - r["feedback_at"])
        after = [t for lv, t in live.items() if lv >= v and t >= versions[v].created_at]
        if after:
            to_live.append(min(after) - r["feedback_at"])
        if stage_times and gid in stage_times:
            resolved, labeled = stage_times[gid]
            ingest.append(resolved - r["feedback_at"])
            reward.append(labeled - resolved)
            trainer.append(versions[v].created_at - labeled)
    ckpt_to_live = [t - versions[v].created_at for v, t in live.items() if v in versions and v > 0]
    out = {"feedback_to_checkpoint_s": _spread(to_ckpt), "checkpoint_to_canary_s": _spread(ckpt_to_live),
           "feedback_to_canary_s": _spread(to_live)}
    if stage_times:
        out |= {"ingest_s": _spread(ingest), "reward_s": _spread(reward), "trainer_s": _spread(trainer)}
    return out


def per_version(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Answers (rows served: one per choice), accept rate, request latency, share of distinct
    answers and the simulator's quality score (local/simulate.py: a score apart from any cohort's taste, which a version that games
    its users lowers) by serving version, from the answers the simulated users got."""
    out: dict[int, dict[str, Any]] = {}
    for v in sorted({r["version"] for r in rows if r.get("version") is not None}):
        mine = [r for r in rows if r.get("version") == v and r.get("status") == 200]
        texts = [r.get("text") for r in mine if r.get("text") is not None]
        judged = _judged(mine)
        lat = [r["latency_s"] for r in mine]
        out[v] = {"requests": len(mine), "judged": len(judged), "accept_rate": _rate(judged),
                  "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
                  "distinct": len(set(texts)) / len(texts) if texts else None,
                  "quality": sum(map(quality, texts)) / len(texts) if texts else None}
    return out


def learning(rows: list[dict[str, Any]], audit: list[dict[str, Any]], start: float | None, started_at: float,
             ended_at: float) -> dict[str, Any]:
    """What the learning goals are judged on, from the traffic of versions that stayed live:
    ``held``, the accept rate over the last :data:`HOLD_S` (and its judgements); ``held_2x_from_s``,
    seconds of traffic until :data:`HOLD_S` windows reached twice the start and stayed there to
    the end; ``last_live``, the last version that went live and stayed, against the start."""
    gone = fallen(audit)
    stayed = kept(rows, gone)
    held, n = held_rate(stayed, started_at, ended_at)
    windows = accept_windows(stayed, started_at, ended_at, window_s=HOLD_S)
    return {"held": held, "held_judged": n, "hold_s": HOLD_S, "held_2x_from_s": held_from(windows, start),
            "left_out": sorted(gone), "last_live": last_live(rows, audit, gone),
            "lift_z_goal": LIFT_Z, "held_windows": [{"t": t, "accept_rate": r, "judged": k} for t, r, k in windows]}


def answer_timeline(answers: dict[str, Any] | None, promoted: list[dict[str, Any]], versions: dict[int, dict[str, Any]],
                    started_at: float) -> list[dict[str, Any]]:
    """The stable version's answers to the fixed prompts, from the start through each promotion
    in order, and the newest version last when it was never promoted: each with when it became
    stable, its accept rate and judgements as users met it (``versions``: :func:`per_version`)
    and, per answer, whether the users' taste likes it. ``answers``: ``prompts``, the taste's
    ``preference`` (local/simulate.py) and ``by_version`` (version -> one answer per prompt);
    a version it lacks (its checkpoint was unreadable) is left out."""
    if not answers:
        return []
    by_version = {int(v): texts for v, texts in answers["by_version"].items()}
    liked = PREFERENCES[answers["preference"]]
    order = [(0, "start", None)] + [(int(d["version"]), "promoted", d["at"] - started_at) for d in promoted]
    newest = answers.get("newest")
    if newest is not None and newest not in [v for v, _, _ in order]:
        order.append((int(newest), "newest, never promoted", None))
    out = []
    for v, role, at in order:
        if v not in by_version:
            continue
        met = versions.get(v, {})
        out.append({"version": v, "role": role, "after_s": at, "accept_rate": met.get("accept_rate"),
                    "judged": met.get("judged", 0),
                    "answers": [{"prompt": p, "text": t, "liked": liked(t, p)} for p, t in zip(answers["prompts"],
                                                                                              by_version[v])]})
    return out


def summarise(rows: list[dict[str, Any]], audit: list[dict[str, Any]], versions: dict[int, Version],
              started_at: float, ended_at: float, policy: dict[str, Any] | None = None,
              stage_times: dict[str, tuple[float, float]] | None = None,
              taste: dict[str, Any] | None = None, answers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the report shows, and each goal with whether it was met. ``taste``: the newest
    version against the starting model, sampled offline (local/taste.py's ``compare``, with the
    version); None when not measured, which meets no goal. ``answers``: the fixed prompts'
    answers by version (:func:`answer_timeline`), None on the built model."""
    windows = accept_windows(rows, started_at, ended_at)
    live = live_times(audit)
    start = start_rate(rows, started_at, min((t for v, t in live.items() if v > 0), default=None), windows)
    learned = learning(rows, audit, start, started_at, ended_at)
    rated = [r for _, r, _ in windows if r is not None]
    decided = decisions(audit)
    promoted = [d for d in decided if d["to"] == "promoted"]
    trained = sorted((v for v in versions.values() if v.step > 0 and "entropy" in v.metrics), key=lambda v: v.version)
    entropy_start = trained[0].metrics["entropy"] if trained else None
    entropy_min = min(v.metrics["entropy"] for v in trained) if trained else None
    by_version = per_version(rows)
    served = [r.get("text") for r in rows if r.get("status") == 200 and r.get("text") is not None]
    scores = held_out(audit)
    distinct = len(set(served)) / len(served) if served else None
    goals = {
        "accept_rate_doubled_and_held": learned["held"] is not None and bool(start) and learned["held"] >= 2 * start,
        "last_live_version_beat_its_stable_arm": (learned["last_live"]["z"] is not None
                                                  and learned["last_live"]["z"] >= LIFT_Z),
        "newest_version_learned_the_taste": bool(taste) and taste.get("z") is not None and taste["z"] >= TASTE_Z,
        "a_version_canaried_and_promoted": bool(promoted) and any(v > 0 for v in live),
        "entropy_above_half_its_start": (entropy_start is not None and entropy_min is not None
                                         and entropy_min >= MIN_ENTROPY_SHARE * entropy_start),
        "completions_distinct": distinct is not None and distinct >= MIN_DISTINCT,
        # a version that learned to please its users by saying what is not so loses answers it had
        "held_out_not_below_the_start": held_out_kept(scores, promoted[-1]["version"] if promoted else 0,
                                                     (policy or {}).get("eval_margin", 0.0)),
    }
    return {
        "started_at": started_at, "traffic_s": round(ended_at - started_at, 1),
        # a row per request refused or failed, a row per answer given (two for a request of n=2)
        "requests": len(rows), "answered": sum(1 for r in rows if r.get("status") == 200),
        "judged": len(_judged(rows)),
        "accept_rate": {"start": start, "end": rated[-1] if rated else None, "best": max(rated) if rated else None,
                        "window_s": WINDOW_S, **learned},
        "windows": [{"t": t, "accept_rate": r, "judged": n} for t, r, n in windows],
        "versions": by_version,
        "published": len([v for v in versions.values() if v.version > 0]),
        "canaried": sorted(v for v in live if v > 0),
        "promoted": [d["version"] for d in promoted],
        "decisions": decided,
        "latency": latencies(rows, versions, live, stage_times),
        "entropy": {"start": entropy_start, "min": entropy_min,
                    "by_version": {v.version: v.metrics["entropy"] for v in trained}},
        "distinct": distinct,
        "policy": policy or {},
        "taste": {**(taste or {}), "z_goal": TASTE_Z},
        "answers": answer_timeline(answers, promoted, by_version, started_at),
        "held_out": {str(v): scores[v] for v in sorted(scores)},
        "goals": goals,
    }


# -- rendering -------------------------------------------------------------------------------
def require_plot() -> Any:
    """matplotlib, or MissingExtra naming the extra that installs it (flywheel/extras.py)."""
    from flywheel.extras import require

    return require("matplotlib", "demo", "The demo report's plot")


def write_png(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> Path:
    """Accept rate over time (overall, and each version's answers) with the release decisions
    marked; request latency under it."""
    matplotlib = require_plot()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = summary["started_at"]
    fig, (ax, lat) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1.3))
    pts = [(w["t"], w["accept_rate"]) for w in summary["windows"] if w["accept_rate"] is not None]
    if pts:
        ax.plot(*zip(*pts), color="black", lw=2, label=f"all users ({summary['accept_rate']['window_s']:.0f} s window)")
    held = [(w["t"], w["accept_rate"]) for w in summary["accept_rate"]["held_windows"] if w["accept_rate"] is not None]
    if held:
        ax.plot(*zip(*held), color="black", lw=1.5, ls="--",
                label=f"versions that stayed live ({summary['accept_rate']['hold_s']:.0f} s window)")
    judged = _judged(rows)
    for v in sorted({r["version"] for r in judged}):
        mine = [r for r in judged if r["version"] == v]
        series = []
        for b in range(0, int(summary["traffic_s"]) + 15, 15):
            inside = [r for r in mine if b <= r["at"] - t0 < b + 15]
            if len(inside) >= 5:
                series.append((b + 7.5, _rate(inside)))
        if series:
            ax.plot(*zip(*series), marker="o", ms=4, lw=0.8, alpha=0.8, label=f"v{v}'s answers")
    colors = {"canary": "tab:blue", "promoted": "tab:green", "rolled_back": "tab:red", "rejected": "tab:red",
              "held": "tab:orange", "awaiting_approval": "tab:orange"}
    for d in summary["decisions"]:
        x = d["at"] - t0
        if 0 <= x <= summary["traffic_s"] + 5:
            ax.axvline(x, color=colors.get(d["to"], "grey"), ls="--", lw=1)
            ax.text(x, 1.01, f"v{d['version']} {d['to']}", rotation=90, va="bottom", ha="right", fontsize=7,
                    color=colors.get(d["to"], "grey"))
    start = summary["accept_rate"]["start"]
    if start:
        ax.axhline(2 * start, color="grey", ls=":", lw=1, label=f"twice the start ({2 * start:.2f})")
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("accept rate")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Simulated users' accept rate while the loop trains and releases", pad=62)
    ok = [r for r in rows if r.get("status") == 200]
    if ok:
        lat.scatter([r["at"] - t0 for r in ok], [r["latency_s"] * 1000 for r in ok], s=3, alpha=0.4)
    lat.set_ylabel("request latency (ms)")
    lat.set_xlabel("seconds of traffic")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: Any, unit: str = "", digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def learning_line(acc: dict[str, Any]) -> str:
    """The learning goals' numbers in a sentence (the page and ``flywheel demo``'s output)."""
    held, last, since = acc["held"], acc["last_live"], acc["held_2x_from_s"]
    kept_note = "counting only versions that stayed live" + (
        f" (left out, rolled back or rejected: {', '.join(f'v{v}' for v in acc['left_out'])})" if acc["left_out"] else "")
    if held is None and not acc["held_windows"]:
        out = f"The run was shorter than the {acc['hold_s']:.0f} s a doubling must hold over. "
    elif held is None:
        out = (f"The last {acc['hold_s']:.0f} s, {kept_note}, held {acc['held_judged']} judgements: too few to show "
               f"a doubling held. ")
    else:
        out = (f"Over the last {acc['hold_s']:.0f} s, {kept_note}, the accept rate was {held:.2f} over "
               f"{acc['held_judged']} judged" + (f" (twice the start: {2 * acc['start']:.2f})" if acc["start"] else "")
               + (f"; at twice the start from {since:.0f} s of traffic to the end. " if since is not None
                  else "; not at twice the start to the end. "))
    if last["version"] is None or last["z"] is None:
        return out + ("No trained version stayed live after a canary with enough users on both arms to compare "
                      "with its stable arm.")
    return out + (f"The last version live and kept, v{last['version']}, was accepted by {last['accept_rate']:.2f} of "
                  f"its canary's {last['users']} users, against {last['stable_rate']:.2f} of {last['stable_users']} "
                  f"on stable v{last['stable_version']} over the same {last['canary_s']:.0f} s (one outcome per "
                  f"user): z {last['z']:.1f} (goal {acc['lift_z_goal']:g}).")


def taste_line(taste: dict[str, Any]) -> str:
    """The offline measure in a sentence (the page and ``flywheel demo``'s output)."""
    if taste.get("z") is None:
        return "The newest version was not measured offline."
    (a0, n0), (a1, n1) = taste["start"], taste["newest"]
    return (f"Sampled offline and judged by the simulated users, the newest version v{taste['version']} was accepted "
            f"{a1 / n1:.2f} of {n1} judged against the starting model's {a0 / n0:.2f} of {n0}, the same draws, "
            f"compared prompt by prompt over {taste['prompts']} prompts: z {taste['z']:.1f} "
            f"(goal {taste['z_goal']:g}).")


def column_title(col: dict[str, Any]) -> str:
    """One version of the answer timeline as a heading: which, when, and how users met it."""
    when = {"start": "at the start", "promoted": f"promoted after {_fmt(col['after_s'], ' s', 0)}"}.get(
        col["role"], col["role"])
    if not col["judged"]:
        return f"v{col['version']}, {when}: no user judged its answers"
    return f"v{col['version']}, {when}: accept rate {_fmt(col['accept_rate'])} over {col['judged']} judged"


def _answers_html(timeline: list[dict[str, Any]]) -> str:
    if not timeline:
        return ""
    e = html.escape
    head = "".join(f"<th>{e(column_title(c))}</th>" for c in timeline)
    rows = "".join(
        f"<tr><td>{e(a['prompt'])}</td>" + "".join(
            f"<td class={'liked' if c['answers'][i]['liked'] else 'plain'}>{e(c['answers'][i]['text'])}</td>"
            for c in timeline) + "</tr>"
        for i, a in enumerate(timeline[0]["answers"]))
    return (f"<h2>What the stable version answered</h2><p>Greedy answers to fixed prompts, generated offline "
            f"from each version's checkpoint: at the start, after each promotion, and the newest version; an "
            f"answer the users' taste accepts is green.</p><table class=answers><tr><th>prompt</th>{head}</tr>{rows}</table>")


def write_html(summary: dict[str, Any], png: Path | None, path: Path) -> Path:
    """One self-contained page: the goals, the plot, versions, decisions and latencies."""
    e = html.escape
    t0 = summary["started_at"]
    acc = summary["accept_rate"]
    goal_rows = "".join(f"<tr><td>{e(k.replace('_', ' '))}</td><td class={'ok' if v else 'no'}>"
                        f"{'MET' if v else 'NOT MET'}</td></tr>" for k, v in summary["goals"].items())
    held = summary.get("held_out") or {}
    ways = sorted({k for scores in held.values() for k in scores})

    def held_cells(v: Any) -> str:
        mine = held.get(str(v), {})
        return "".join(f"<td>{_fmt(mine[k]['score'], '', 3)} ({mine[k]['right']} right, {mine[k]['wrong']} wrong)</td>"
                       if k in mine else "<td>-</td>" for k in ways)

    ver_rows = "".join(
        f"<tr><td>v{v}</td><td>{s['requests']}</td><td>{s['judged']}</td><td>{_fmt(s['accept_rate'])}</td>{held_cells(v)}"
        f"<td>{_fmt(s['latency_p50_s'] and s['latency_p50_s'] * 1000, ' ms', 0)}</td>"
        f"<td>{_fmt(s['latency_p95_s'] and s['latency_p95_s'] * 1000, ' ms', 0)}</td><td>{_fmt(s['distinct'])}</td>"
        f"<td>{_fmt(s['quality'])}</td></tr>"
        for v, s in summary["versions"].items())
    dec_rows = "".join(
        f"<tr><td>{_fmt(d['at'] - t0, ' s', 0)}</td><td>v{e(str(d['version']))}</td><td>{e(str(d['from']))} → "
        f"{e(str(d['to']))}</td><td>{e(str(d['actor']))}</td><td>{e(d['reason'])}</td></tr>" for d in summary["decisions"])
    lat_rows = "".join(f"<tr><td>{e(k.replace('_s', '').replace('_', ' '))}</td><td>{v['n']}</td>"
                       f"<td>{_fmt(v['p50'], ' s', 1)}</td><td>{_fmt(v['p95'], ' s', 1)}</td></tr>"
                       for k, v in summary["latency"].items())
    policy = "".join(f"<li>{e(k)}: {e(str(v))}</li>" for k, v in summary["policy"].items())
    img = ""
    if png is not None and png.exists():
        img = f'<img alt="accept rate over time" src="data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}">'
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Flywheel run report</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
.ok{{color:#060;font-weight:bold}}.no{{color:#a00;font-weight:bold}}img{{max-width:100%}}
.liked{{background:#e4f5e4}}.answers td{{vertical-align:top;max-width:280px}}</style></head>
<body><h1>Flywheel: the whole loop, one run</h1>
<p>{summary['answered']} answers over {summary['traffic_s']:.0f} s of simulated traffic,
{summary['judged']} judged. Accept rate {_fmt(acc['start'])} before the first trained version went
live, {_fmt(acc['end'])} in the last {acc['window_s']:.0f} s. {e(learning_line(acc))}
{e(taste_line(summary['taste']))}
{summary['published']} versions published, {len(summary['canaried'])} canaried, {len(summary['promoted'])} promoted.</p>
<h2>Goals</h2><table><tr><th>goal</th><th></th></tr>{goal_rows}</table>
{_answers_html(summary.get('answers') or [])}
{img}
<h2>Versions as users met them</h2>
<table><tr><th>version</th><th>answers</th><th>judged</th><th>accept rate</th>{"".join(
    f"<th>held-out {e(k)}</th>" for k in ways)}<th>latency p50</th><th>p95</th>
<th>distinct answers</th><th>quality</th></tr>{ver_rows}</table>
<p>Held-out: questions no user asks whose answers are known, scored at the release gate (right 1,
wrong 0, no answer 0.5; release/evals.py).</p>
<h2>Release decisions</h2>
<table><tr><th>after</th><th>version</th><th>change</th><th>by</th><th>why</th></tr>{dec_rows}</table>
<h2>From feedback to users</h2>
<table><tr><th>stretch</th><th>n</th><th>p50</th><th>p95</th></tr>{lat_rows}</table>
<p>Per-token entropy (trainer): {_fmt(summary['entropy']['start'])} nats at the first trained version,
lowest {_fmt(summary['entropy']['min'])}. Distinct answers: {_fmt(summary['distinct'])}.</p>
<h2>Release policy of this run</h2><ul>{policy}</ul>
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path

