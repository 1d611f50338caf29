"""The run report's numbers (local/report.py): accept-rate windows, doubling, decisions, latencies."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import pytest

from local.evidence import prompt_paired
from local.report import (
    HOLD_S,
    MIN_JUDGED,
    TASTE_Z,
    Canary,
    Version,
    accept_windows,
    canaries,
    decisions,
    fallen,
    held_from,
    held_rate,
    kept,
    last_live,
    latencies,
    learning_line,
    lift_z,
    live_times,
    per_version,
    read_stage_times,
    read_versions,
    start_rate,
    summarise,
    taste_line,
    write_html,
    write_png,
)

T0 = 1000.0
_USERS = itertools.count()


def row(at: float, signal: str | None, version: int = 0, *, cohort: str = "vowels", gid: str | None = None,
        feedback_at: float | None = None, text: str | None = None, status: int = 200, latency: float = 0.1,
        user: str | None = None) -> dict:
    """One request; by a user of its own unless ``user`` names one."""
    return {"at": T0 + at, "signal": signal, "version": version, "cohort": cohort, "generation_id": gid,
            "feedback_at": feedback_at, "text": text if text is not None else f"answer {at}", "status": status,
            "latency_s": latency, "user": user if user is not None else f"u{next(_USERS)}"}


def judged(start: float, n: int, accepts: int, version: int = 0, spacing: float = 1.0, user: str | None = None) -> list[dict]:
    """``n`` judgements spread over ``spacing`` seconds, ``accepts`` of them accepts, spread evenly."""
    return [row(start + i * spacing / n, "accept" if (i + 1) * accepts // n > i * accepts // n else "reject", version,
                user=user) for i in range(n)]


def audit_of(*events: tuple[int, str, float]) -> list[dict]:
    """(version, to state, seconds after T0) as audit entries."""
    return [{"at": T0 + at, "version": v, "from_state": None, "to_state": to, "actor": "controller", "reason": ""}
            for v, to, at in events]


def test_windows_rate_only_with_enough_judgements_and_leave_out_the_abuser():
    rows = judged(0, MIN_JUDGED, 5, spacing=20) + [row(1, "accept", cohort="abuser")] * 50
    rows += [row(2, None)] * 5  # answers without feedback are no judgement
    w = accept_windows(rows, T0, T0 + 35, window_s=30, step_s=5)
    assert [t for t, _, _ in w] == [30, 35]
    assert w[0] == (30, 5 / MIN_JUDGED, MIN_JUDGED)
    assert w[1][1] is None  # the window 5..35 holds 15 of them: too few to rate


@pytest.mark.parametrize("rates, start, since", [
    ([0.25, 0.3, 0.49, 0.5, 0.6], 0.25, 20.0),  # at 2x from the 4th window to the end
    ([0.25, 0.5, 0.6, 0.4], 0.25, None),  # a peak that did not hold is no doubling
    ([0.25, 0.5, 0.4, 0.5, 0.5], 0.25, 20.0),  # a dip starts the hold again
    ([0.2, 0.45, None, 0.45], 0.2, 20.0),  # a window too thin to rate breaks the hold
    ([0.25, 0.3, 0.4], 0.25, None),
    ([None, None], 0.2, None),
    ([0.0, 0.5], 0.0, None),  # twice nothing is no doubling
    ([0.3, 0.5], None, None),
])
def test_a_doubling_counts_once_it_holds_to_the_end(rates, start, since):
    windows = [(5.0 * (i + 1), r, 0) for i, r in enumerate(rates)]
    assert held_from(windows, start) == since


def test_the_held_rate_is_the_last_minute_of_traffic():
    rows = judged(0, 60, 15, spacing=60) + judged(60, 60, 36, version=1, spacing=60)  # 0.25, then 0.6
    assert held_rate(rows, T0, T0 + 120) == (pytest.approx(0.6), 60)
    assert held_rate(rows, T0, T0 + 120, hold_s=120) == (pytest.approx(51 / 120), 120)
    # shorter than the hold: the last minute would hold the start too
    assert held_rate(rows, T0, T0 + 50) == (None, 50)
    assert held_rate(judged(0, MIN_JUDGED - 1, 5, spacing=60), T0, T0 + 60) == (None, MIN_JUDGED - 1)


@pytest.mark.parametrize("audit, gone", [
    ([], frozenset()),
    ([{"version": 3, "to_state": "canary"}, {"version": 3, "to_state": "rolled_back"},
      {"version": 4, "to_state": "rejected"}, {"version": 5, "to_state": "promoted"}], frozenset({3, 4})),
    ([{"version": 6, "to_state": "canary"}], frozenset()),  # undecided at the end: live to the end
    ([{"version": None, "to_state": "rolled_back"}], frozenset()),
])
def test_versions_rolled_back_or_rejected_fall_out(audit, gone):
    assert fallen(audit) == gone
    rows = [row(0, "accept", v) for v in (0, 3, 4, 5, 6)]
    assert [r["version"] for r in kept(rows, gone)] == [v for v in (0, 3, 4, 5, 6) if v not in gone]


@pytest.mark.parametrize("before, after, z", [
    ((100, 25), (100, 50), 3.651),  # pooled 0.375: (0.5 - 0.25) / sqrt(0.375 * 0.625 * 0.02)
    ((100, 25), (100, 25), 0.0),
    ((400, 100), (50, 20), 2.261),  # a real rise, too few judgements to tell from noise
    ((100, 40), (100, 20), -3.086),  # a fall is no lift
    ((10, 0), (10, 0), None),  # no spread
    ((0, 0), (10, 5), None),
])
def test_lift_is_a_two_proportion_z(before, after, z):
    got = lift_z((before[1], before[0]), (after[1], after[0]))
    assert got == (pytest.approx(z, abs=1e-3) if z is not None else None)


@pytest.mark.parametrize("events, want", [
    ([], []),
    # promoted: its canary ran from +10 to +40 against v0; v2's against v1, still running
    ([(1, "canary", 10), (1, "promoted", 40), (2, "canary", 50)],
     [Canary(1, T0 + 10, T0 + 40, 0), Canary(2, T0 + 50, None, 1)]),
    # held and awaiting approval still serve the canary's share; a rollback ends it, stable stays
    ([(1, "canary", 10), (1, "held", 55), (1, "rolled_back", 70), (2, "canary", 80), (2, "awaiting_approval", 90),
      (2, "promoted", 99)], [Canary(1, T0 + 10, T0 + 70, 0), Canary(2, T0 + 80, T0 + 99, 0)]),
    ([(3, "candidate", 1), (3, "gating", 2), (3, "superseded", 3)], []),  # never served
])
def test_canaries_run_from_canary_to_leaving_the_canary_states_against_the_stable_of_the_time(events, want):
    assert canaries(audit_of(*events)) == want


def test_the_last_live_version_is_judged_against_its_stable_arm_over_the_same_seconds():
    # v1 canaried at +40 (against v0, promoted at +70), v2 at +70 (against v1, promoted at +100),
    # v3 at +100 and rolled back: v2 is the last that stayed
    audit = audit_of((1, "canary", 40), (1, "promoted", 70), (2, "canary", 70), (2, "promoted", 100),
                     (3, "canary", 100), (3, "rolled_back", 120))
    rows = (judged(0, 100, 25, spacing=40) + judged(40, 30, 9, spacing=30) + judged(40, 30, 12, version=1, spacing=30)
            + judged(70, 40, 16, version=1, spacing=30) + judged(70, 40, 28, version=2, spacing=30)
            + judged(100, 30, 6, version=3, spacing=20) + judged(100, 30, 21, version=2, spacing=20))
    got = last_live(rows, audit, frozenset({3}))
    assert (got["version"], got["stable_version"]) == (2, 1)
    assert (got["accept_rate"], got["users"], got["stable_rate"], got["stable_users"]) == (0.7, 40, 0.4, 40)
    assert got["z"] == pytest.approx(lift_z((16, 40), (28, 40))) and got["canary_s"] == 30
    # a version canaried in the last seconds, with too few users on an arm, is no evidence either way
    thin = rows + judged(118, MIN_JUDGED - 1, 19, version=4, spacing=1) + judged(118, 30, 10, version=2, spacing=1)
    assert last_live(thin, audit + audit_of((4, "canary", 118)), frozenset({3}))["version"] == 2
    assert last_live(rows, audit, frozenset({1, 2, 3}))["version"] is None
    # promoted without a canary: no arm ran beside it, so there is nothing to compare with
    assert last_live(rows, audit_of((1, "promoted", 40)), frozenset())["version"] is None


def test_a_rise_over_time_that_lifts_both_arms_is_no_lift():
    # every user accepts more often from +60 on, whichever version answers (a later crowd, a time
    # of day): v1 is no better than v0 beside it. Against the traffic before its canary (the old
    # measure) it read as z 3.7
    rows = judged(0, 100, 25, spacing=60) + judged(60, 100, 50, spacing=60) + judged(60, 100, 50, version=1, spacing=60)
    audit = audit_of((1, "canary", 60), (1, "promoted", 120))
    s = summarise(rows, audit, {}, T0, T0 + 120)
    assert s["accept_rate"]["last_live"]["z"] == 0.0
    assert not s["goals"]["last_live_version_beat_its_stable_arm"]


def test_a_user_who_judges_often_counts_once_on_the_live_comparison():
    # 30 users on each arm, 9 of whom accept first; one canary user then accepts 60 more answers
    # (the controller counts one outcome per user: their first)
    heavy = [row(61 + i * 0.5, "accept", 1, user="heavy") for i in range(60)]
    rows = (judged(60, 30, 9, spacing=30) + judged(60, 29, 9, version=1, spacing=30)
            + [row(60.5, "reject", 1, user="heavy")] + heavy)
    got = last_live(rows, audit_of((1, "canary", 60)), frozenset())
    assert (got["users"], got["accept_rate"], got["stable_rate"]) == (30, 0.3, 0.3) and got["z"] == 0.0


def test_the_start_is_every_judgement_before_the_first_trained_version_went_live():
    rows = judged(0, 40, 20, spacing=10) + judged(10, 60, 12, spacing=50)  # 0.5 early, 0.2 until +60
    windows = accept_windows(rows, T0, T0 + 60)
    assert start_rate(rows, T0, T0 + 60, windows) == pytest.approx(32 / 100)
    # live within the first window: too little before it, so the first window is the start
    assert start_rate(rows, T0, T0 + 20, windows) == windows[0][1]
    assert start_rate(rows, T0, None, windows) == windows[0][1]


def _eval(method: str, stable: tuple[int, int], candidate: tuple[int, int], items: int = 344) -> dict:
    """A gate's record of one held-out eval (release/judge.py ``EvalScore``): (right, wrong) of each."""
    return {"name": "known_answers", "method": method, "items": items, "stable_right": stable[0],
            "stable_wrong": stable[1], "candidate_right": candidate[0], "candidate_wrong": candidate[1],
            "diff_sum": 0.0, "diff_sq": 0.0}


AUDIT = [
    {"at": T0 + 1, "version": 1, "from_state": None, "to_state": "candidate", "actor": "controller", "reason": "x"},
    {"at": T0 + 2, "version": 1, "from_state": "candidate", "to_state": "gating", "actor": "controller", "reason": "g"},
    {"at": T0 + 5, "version": 1, "from_state": "gating", "to_state": "canary", "actor": "controller", "reason": "c",
     "evidence": {"gate": {"stable_version": 0, "evals": [_eval("greedy", (60, 30), (90, 30)),
                                                          _eval("likelihood", (180, 164), (181, 163))]}}},
    {"at": T0 + 40, "version": 1, "from_state": "canary", "to_state": "promoted", "actor": "controller (auto-promote)",
     "reason": "passed"},
    {"at": T0 + 41, "version": 2, "from_state": "candidate", "to_state": "superseded", "actor": "controller",
     "reason": "newer"},
    {"at": T0 + 50, "version": 3, "from_state": "gating", "to_state": "canary", "actor": "controller", "reason": "c"},
    {"at": T0 + 70, "version": 3, "from_state": "canary", "to_state": "rolled_back", "actor": "controller",
     "reason": "fail"},
]


def test_decisions_keep_what_changed_for_users_in_time_order():
    assert [(d["version"], d["to"]) for d in decisions(list(reversed(AUDIT)))] == [
        (1, "canary"), (1, "promoted"), (3, "canary"), (3, "rolled_back")]
    assert live_times(AUDIT) == {1: T0 + 5, 3: T0 + 50}


def test_latencies_follow_a_judgement_to_the_first_live_version_that_holds_it():
    versions = {0: Version(0, T0 - 100, 0, 0), 1: Version(1, T0 + 3, 16, 16, frozenset({"a"})),
                2: Version(2, T0 + 30, 32, 16, frozenset({"b"})), 3: Version(3, T0 + 45, 48, 16, frozenset({"c"}))}
    rows = [row(0, "accept", gid="a", feedback_at=T0 + 1), row(10, "reject", gid="b", feedback_at=T0 + 12),
            row(20, "accept", gid="c", feedback_at=T0 + 22), row(21, "accept", gid="nowhere", feedback_at=T0 + 23)]
    lat = latencies(rows, versions, live_times(AUDIT))
    assert lat["feedback_to_checkpoint_s"] == {"n": 3, "p50": 18.0, "p95": 23.0}
    # a: v1 went live at +5 (4 s); b: v2 never did, v3 (which holds it too) at +50 (38 s); c: v3 (28 s)
    assert lat["feedback_to_canary_s"] == {"n": 3, "p50": 28.0, "p95": 38.0}
    assert lat["checkpoint_to_canary_s"] == {"n": 2, "p50": 2.0, "p95": 5.0}
    assert "ingest_s" not in lat  # no archives, no split
    split = latencies(rows, versions, live_times(AUDIT), {"a": (T0 + 2, T0 + 2.5), "c": (T0 + 23, T0 + 25)})
    assert split["ingest_s"] == {"n": 2, "p50": 1.0, "p95": 1.0}
    assert split["reward_s"] == {"n": 2, "p50": 0.5, "p95": 2.0}
    assert split["trainer_s"] == {"n": 2, "p50": 0.5, "p95": 20.0}  # a: v1 at +3; c: v3 at +45


def test_stage_times_are_read_from_the_archives(tmp_path):
    import pandas as pd

    (tmp_path / "episodes" / "hour=x").mkdir(parents=True)
    (tmp_path / "rewards" / "hour=x").mkdir(parents=True)
    pd.DataFrame({"generation_id": ["a", "b", "a"], "resolved_at": [1.0, 2.0, 1.0]}).to_parquet(
        tmp_path / "episodes" / "hour=x" / "p.parquet")
    pd.DataFrame({"generation_id": ["a"], "labeled_at": [1.5]}).to_parquet(tmp_path / "rewards" / "hour=x" / "p.parquet")
    assert read_stage_times(tmp_path) == {"a": (1.0, 1.5)}  # b has no reward yet; a repeat counts once
    assert read_stage_times(tmp_path / "missing") == {}


def test_per_version_counts_distinct_answers_and_latency():
    rows = [row(0, "accept", 0, text="x", latency=0.1), row(1, "reject", 0, text="x", latency=0.3),
            row(2, "accept", 1, text="y"), row(3, None, 1, text="z"), row(4, None, None, status=429)]
    out = per_version(rows)
    assert out[0] == {"requests": 2, "judged": 2, "accept_rate": 0.5, "latency_p50_s": 0.1, "latency_p95_s": 0.3,
                      "distinct": 0.5, "quality": 0.0}
    assert out[1]["accept_rate"] == 1.0 and out[1]["judged"] == 1 and out[1]["distinct"] == 1.0


@pytest.mark.parametrize("texts, score", [
    (["abcd"], 1.0),  # ab, bc, cd: every pair distinct
    (["aaaa"], 1 / 3),  # the shortcut: aa three times
    (["abcd", "aaaa"], 2 / 3),  # the mean over the version's answers
    (["abab"], 2 / 3),  # ab, ba, ab
    (["", "x", "abcd"], 1 / 3),  # an answer without pairs scores 0, as the simulator scores it
    ([None, None], None),  # no answer text: nothing to score
])
def test_per_version_quality_is_the_simulators_score_of_its_answers(texts, score):
    rows = [dict(row(i, "accept", 2), text=t) for i, t in enumerate(texts)] + [row(9, "accept", 3, text="abc")]
    out = per_version(rows)
    assert out[2]["quality"] == (pytest.approx(score) if score is not None else None)
    assert out[3]["quality"] == 1.0


def _run_rows() -> list[dict]:
    """0.25 accepted for the first minute (v0), then 0.75 (v1, canaried at +60 in RUN_AUDIT), and
    v0 beside it at 0.25 until its promotion at +95: 20 users of the stable arm."""
    return judged(0, 60, 15, spacing=60) + judged(60, 20, 5, spacing=35) + judged(60, 60, 45, version=1, spacing=60)


#: AUDIT 55 s later: v1 canaried at +60 (as _run_rows' traffic has it), promoted at +95; v3
#: canaried at +105 and rolled back after the traffic ended
RUN_AUDIT = [{**e, "at": e["at"] + 55} for e in AUDIT]


def test_summary_states_each_goal():
    versions = {1: Version(1, T0 + 3, 16, 16, frozenset(), {"entropy": 6.0}),
                2: Version(2, T0 + 30, 32, 16, frozenset(), {"entropy": 3.5})}
    taste = {**_taste([((15, 60), (26 + (i < 6), 60)) for i in range(15)]), "version": 2}
    s = summarise(_run_rows(), RUN_AUDIT, versions, T0, T0 + 120, {"promotion": "auto"}, taste=taste)
    acc = s["accept_rate"]
    assert acc["start"] == 0.25  # the first minute, before v1 went live
    assert acc["held"] == pytest.approx(0.625) and acc["held_judged"] == 80 and acc["hold_s"] == HOLD_S
    # the minute ending at 100 s holds 40 judgements at 0.25 (before v1, and beside it) and 40 at
    # 0.75: 0.5, the first at 2x
    assert acc["held_2x_from_s"] == 100 and acc["left_out"] == [3]
    # v1's 35 users in its canary (26 accepted) against v0's 20 over the same 35 s
    assert acc["last_live"]["version"] == 1 and acc["last_live"]["z"] == pytest.approx(lift_z((5, 20), (26, 35)))
    assert s["promoted"] == [1] and s["canaried"] == [1, 3]
    assert s["goals"] == {"accept_rate_doubled_and_held": True, "last_live_version_beat_its_stable_arm": True,
                          "newest_version_learned_the_taste": True, "a_version_canaried_and_promoted": True,
                          "entropy_above_half_its_start": True, "completions_distinct": True,
                          "held_out_not_below_the_start": True}
    assert s["held_out"]["1"]["known_answers (greedy)"] == {"score": (90 + 224 / 2) / 344, "right": 90, "wrong": 30,
                                                            "items": 344}
    assert s["held_out"]["0"]["known_answers (greedy)"]["right"] == 60
    assert s["taste"]["z"] > TASTE_Z and "v2 was accepted 0.44 of 900" in taste_line(s["taste"])
    assert "prompt by prompt over 15 prompts" in taste_line(s["taste"])
    collapsed = {**versions, 3: Version(3, T0 + 45, 48, 16, frozenset(), {"entropy": 2.9})}
    s = summarise(_run_rows(), AUDIT[:3], collapsed, T0, T0 + 120)
    assert not s["goals"]["entropy_above_half_its_start"]
    assert not s["goals"]["a_version_canaried_and_promoted"]  # canaried, never promoted


def test_traffic_of_a_version_rolled_back_does_not_count_as_learning():
    # v1 canaried at +30 and rolled back at +110; its users accepted it at 0.6 all along: a canary
    # that failed its trial is no doubling users kept, whatever its own rate was
    live, gone = ("canary", T0 + 30), ("rolled_back", T0 + 110)
    audit = [{"at": at, "version": 1, "from_state": None, "to_state": to, "actor": "controller", "reason": ""}
             for to, at in (live, gone)]
    rows = judged(0, 120, 30, spacing=120) + judged(30, 80, 48, version=1, spacing=80)
    s = summarise(rows, audit, {}, T0, T0 + 120)
    assert s["accept_rate"]["held"] == pytest.approx(0.25, abs=0.02) and s["accept_rate"]["left_out"] == [1]
    assert s["accept_rate"]["last_live"]["version"] is None
    assert not s["goals"]["accept_rate_doubled_and_held"]
    assert not s["goals"]["last_live_version_beat_its_stable_arm"]
    # the same traffic with v1 promoted instead: users kept it
    s = summarise(rows, [audit[0], {**audit[1], "to_state": "promoted"}], {}, T0, T0 + 120)
    assert s["accept_rate"]["last_live"]["version"] == 1 and s["goals"]["last_live_version_beat_its_stable_arm"]


def _taste(by_prompt: list[tuple[tuple[int, int], tuple[int, int]]]) -> dict:
    """What local/taste.py's compare reports for these per-prompt (start, newest) counts."""
    paired = prompt_paired(by_prompt)
    return {"version": 3, "start": [sum(s[0] for s, _ in by_prompt), sum(s[1] for s, _ in by_prompt)],
            "newest": [sum(n[0] for _, n in by_prompt), sum(n[1] for _, n in by_prompt)], "z": paired.z,
            "t": paired.t, "prompts": paired.prompts}


@pytest.mark.parametrize("taste, met", [
    (None, False),  # not measured: no goal met
    (_taste([((16, 64), (16, 64))] * 16), False),  # identical weights, same draws: z 0
    # better on every prompt, by 8 to 20 answers of 64: z 5.9
    (_taste([((16, 64), (16 + 8 + i % 13, 64)) for i in range(16)]), True),
    # 24 answers better on 10 prompts, 24 worse on 6: 0.09 on average, z 1.0 over prompts (the
    # 1,024 answers of each side pooled, as if independent: z 4.3, the old goal met)
    (_taste([((16, 64), (40, 64))] * 10 + [((40, 64), (16, 64))] * 6), False),
    (_taste([]), False),
])
def test_the_newest_version_learned_the_taste_offline_by_four_standard_errors(taste, met):
    s = summarise(_run_rows(), RUN_AUDIT, {}, T0, T0 + 120, taste=taste)
    assert s["goals"]["newest_version_learned_the_taste"] is met
    assert " - " not in taste_line(s["taste"])


def test_a_learning_goal_not_met_reads_as_a_sentence_without_dashes():
    s = summarise(judged(0, 40, 10, spacing=40), [], {}, T0, T0 + 45)
    assert s["goals"]["accept_rate_doubled_and_held"] is False
    assert s["goals"]["last_live_version_beat_its_stable_arm"] is False
    line = learning_line(s["accept_rate"])
    assert " - " not in line and "shorter than the 60 s" in line and "No trained version" in line
    line = learning_line(summarise(judged(0, 40, 10, spacing=40), [], {}, T0, T0 + 100)["accept_rate"])
    assert "held 0 judgements: too few" in line
    line = learning_line(summarise(_run_rows(), RUN_AUDIT, {}, T0, T0 + 120)["accept_rate"])
    assert "0.62 over 80 judged" in line and "from 100 s" in line and "v3" in line and "v1" in line
    assert "0.74 of its canary's 35 users, against 0.25 of 20 on stable v0 over the same 35 s" in line


def test_versions_are_read_from_a_checkpoint_store(tmp_path):
    for v in (0, 1):
        d = tmp_path / f"v{v:08d}"
        d.mkdir()
        (d / "flywheel-manifest.json").write_text(json.dumps(
            {"version": v, "created_at": T0 + v, "step": 4 * v, "samples": 16 * v, "metrics": {"entropy": 6.0}}))
        (d / "ledger.json").write_text(json.dumps({"trained": [f"g{v}"], "dropped": {}, "steps": 4 * v}))
    (tmp_path / "v00000002").mkdir()  # being written as the run stopped: no manifest yet
    out = read_versions(tmp_path)
    assert sorted(out) == [0, 1] and out[1].trained == frozenset({"g1"}) and out[1].samples == 16


def test_report_files_are_written_and_the_page_escapes_what_it_shows(tmp_path):
    audit = AUDIT + [{"at": T0 + 80, "version": 4, "from_state": "gating", "to_state": "rejected",
                      "actor": "controller", "reason": "<script>alert(1)</script>"}]
    s = summarise(_run_rows(), audit, {}, T0, T0 + 120)
    png = write_png(s, _run_rows(), tmp_path / "r" / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = write_html(s, png, tmp_path / "r" / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "data:image/png;base64," in page and "v1" in page
    assert "<th>quality</th>" in page


def _gated(version: int, at: float, evals: list[dict], to: str = "canary", stable: int = 0) -> dict:
    return {"at": at, "version": version, "from_state": "gating", "to_state": to, "actor": "controller",
            "reason": "", "evidence": {"gate": {"outcome": "pass", "stable_version": stable, "evals": evals}}}


def test_held_out_scores_by_version_and_the_goal_that_a_lie_cannot_meet():
    from local.report import held_out, held_out_kept

    promote = {"at": T0 + 20, "version": 1, "from_state": "canary", "to_state": "promoted", "actor": "c", "reason": ""}
    # v1 learned to answer first, mostly right; v2, gated against v1, says "No" to everything
    audit = [_gated(1, T0 + 10, [_eval("greedy", (60, 30), (150, 50))]), promote,
             _gated(2, T0 + 30, [_eval("greedy", (150, 50), (130, 130))], to="rejected", stable=1),
             # a gate recorded before gates named their stable: left out, not guessed
             {**_gated(3, T0 + 40, []), "evidence": {"gate": {"evals": [_eval("greedy", (1, 1), (1, 1))]}}}]
    scores = held_out(audit)
    assert scores[0]["known_answers (greedy)"]["score"] == pytest.approx((60 + 254 / 2) / 344)
    assert scores[1]["known_answers (greedy)"]["right"] == 150  # v1's, as candidate and then as stable
    assert scores[2]["known_answers (greedy)"]["score"] == pytest.approx((130 + 84 / 2) / 344)
    assert held_out_kept(scores, 1, 0.05) and held_out_kept(scores, 0, 0.05)
    assert not held_out_kept(scores, 2, 0.0)  # had the lie been promoted
    assert held_out_kept(scores, 2, 0.1)  # ... it loses 0.067 of the start's score: within a margin that wide
    assert not held_out_kept(scores, 3, 0.05)  # a version no gate scored: not measured, not met
    assert 3 not in scores
    lie = [_gated(1, T0 + 10, [_eval("greedy", (150, 50), (130, 130))]), promote]
    s = summarise(_run_rows(), lie, {}, T0, T0 + 120, {"eval_margin": 0.05})
    assert s["goals"]["a_version_canaried_and_promoted"] and not s["goals"]["held_out_not_below_the_start"]
    from local.report import write_html

    page = write_html(s, None, Path(tempfile.mkdtemp()) / "r.html").read_text()
    assert "<th>held-out known_answers (greedy)</th>" in page and "0.500 (130 right, 130 wrong)" in page
