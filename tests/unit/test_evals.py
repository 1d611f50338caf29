"""Held-out evals (release/evals.py): the shipped known-answer set, parsing a free answer, the
paired non-inferiority test (release/judge.py) and the gate's verdict on them."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from flywheel.settings import ReleaseSettings, SettingsError
from release.evals import (
    EVALS,
    KNOWN_ANSWERS,
    EvalError,
    EvalItem,
    evals_named,
    load_items,
    parse_answer,
    register_eval_file,
)
from release.judge import (
    EvalScore,
    GateMeasurement,
    GatePolicy,
    Outcome,
    judge_evals,
    judge_gate,
    non_inferiority,
)

YES = EvalItem("a", "yes_no", "Is ice cold?", "Yes", "No")
NO = EvalItem("b", "yes_no", "Is ice hot?", "No", "Yes")
WORD = EvalItem("c", "word", "What is the capital of Japan? Answer with one word.", "Tokyo", "Kyoto")


def test_the_shipped_set_is_balanced_so_a_constant_answer_scores_half():
    items = load_items(KNOWN_ANSWERS)
    yes_no = [it for it in items if it.kind == "yes_no"]
    assert len(items) >= 300 and len(yes_no) >= 240 and len(items) - len(yes_no) >= 80
    for constant in ("Yes", "No"):
        right = [parse_answer(it, f"{constant}, it is.") for it in yes_no]
        assert sum(right) / len(yes_no) == 0.5
    # and a version that says "No" to everything scores as one that answers nothing
    always_no = EvalScore.of("k", "greedy", [None] * len(yes_no), [parse_answer(it, "No.") for it in yes_no])
    assert always_no.candidate_score == always_no.stable_score == 0.5
    assert len({it.question.lower() for it in items}) == len(items)


@pytest.mark.parametrize(("item", "text", "expected"), [
    (YES, "Yes, ice is cold.", True),
    (YES, "**yes**", True),
    (YES, "No, ice is not cold.", False),
    (NO, "No.", True),
    (YES, "Ice is frozen water.", None),  # answered something else
    (YES, "Yesterday it was cold.", None),  # not the word "yes"
    (YES, "", None),
    (WORD, "Tokyo.", True),
    (WORD, "The capital is tokyo", True),
    (WORD, "Kyoto", False),
    (WORD, "Tokyo or Kyoto", None),  # a hedge is no answer
    (WORD, "Osaka", None),
])
def test_a_free_answer_is_right_wrong_or_no_answer(item, text, expected):
    assert parse_answer(item, text) is expected


@pytest.mark.parametrize(("line", "message"), [
    ('{"id": "x", "kind": "yes_no", "question": "q", "answer": "Yes", "wrong": "Maybe"}', "are 'Yes' and 'No'"),
    ('{"id": "x", "kind": "word", "question": "q", "answer": "New York", "wrong": "Boston"}', "single words"),
    ('{"id": "x", "kind": "word", "question": "q", "answer": "Rome", "wrong": "rome"}', "two different"),
    ('{"id": "x", "kind": "essay", "question": "q", "answer": "a", "wrong": "b"}', "neither"),
    ('{"id": "x", "question": "q"}', "not an eval item"),
    ("not json", "not an eval item"),
])
def test_a_bad_eval_file_is_refused_naming_its_line(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    path.write_text('{"id": "ok", "kind": "yes_no", "question": "Is ice cold?", "answer": "Yes", "wrong": "No"}\n'
                    + line + "\n")
    with pytest.raises(EvalError, match=message) as err:
        load_items(path)
    assert f"{path}:2" in str(err.value)


def test_a_deployment_registers_its_own_set_and_an_unknown_name_is_a_settings_error(tmp_path):
    path = tmp_path / "billing.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "kind": "word", "question": f"Plan {i}?", "answer": "Gold",
                                          "wrong": "Silver"}) for i in range(3)))
    register_eval_file("billing_test", path)
    try:
        got = evals_named(("known_answers", "billing_test"))
        assert [len(v) for v in got.values()][1] == 3
        with pytest.raises(SettingsError, match="unknown eval 'nope'.*billing_test"):
            evals_named(("nope",))
        path.write_text("")
        with pytest.raises(SettingsError, match="billing_test: .* holds no items"):
            evals_named(("billing_test",))
    finally:
        del EVALS["billing_test"]


def _score(n: int, stable: list[bool | None], candidate: list[bool | None]) -> EvalScore:
    return EvalScore.of("set", "greedy", stable * n, candidate * n)


#: (stable's items, the candidate's, repeated n times) -> passes at margin 0.05, level 0.025
NON_INFERIORITY = [
    ("the same answers", 100, [True, False, None], [True, False, None], True),
    ("better everywhere", 100, [None, False], [True, True], True),
    # a version that learned to answer first, and mostly right: better, however much it moved
    ("abstains -> direct, mostly right", 100, [None, None, None], [True, True, False], True),
    # the liar on a balanced set: stable abstained (0.5), the candidate says "No", right half the
    # time; no worse on average, but its answers moved too much to be shown within the margin
    ("abstains -> always no", 130, [None, None], [True, False], False),
    ("right -> always no", 130, [True, True], [True, False], False),
    # one item in twenty lost: the difference is the margin itself, and a bound below it fails
    ("exactly the margin worse", 20, [True] * 20, [True] * 19 + [False], False),
    ("a few flips both ways", 10, [True, False] + [True] * 38, [False, True] + [True] * 38, True),
    ("many flips both ways", 50, [True, False, True, True], [False, True, True, True], False),
    # 1/n alone is past the margin: a set needs more than 1 / eval_margin questions to pass anything
    ("a handful of questions", 1, [True] * 4, [True] * 4, False),
]


@pytest.mark.parametrize(("name", "n", "stable", "candidate", "passes"), NON_INFERIORITY,
                         ids=[r[0] for r in NON_INFERIORITY])
def test_the_candidate_must_be_shown_within_the_margin_of_stable(name, n, stable, candidate, passes):
    failed, passed = judge_evals((_score(n, stable, candidate),), margin=0.05, alpha=0.05)
    assert (not failed) is passes
    assert len(failed) + len(passed) == 1


def test_the_bound_tightens_with_more_questions_and_alpha_is_split():
    few, many = _score(10, [True, False], [False, True]), _score(1000, [True, False], [False, True])
    assert non_inferiority(few, 0.05)[0] == non_inferiority(many, 0.05)[0] == 0.0
    assert non_inferiority(few, 0.05)[1] < non_inferiority(many, 0.05)[1] < 0
    one = judge_evals((many,), 0.05, 0.05)[1][0]
    two = judge_evals((many, many), 0.05, 0.05)[1][0]
    assert "level 0.05)" in one and "level 0.025)" in two
    assert non_inferiority(EvalScore.of("e", "greedy", [], []), 0.05)[1] == float("-inf")


def _gate(evals: tuple[EvalScore, ...]) -> GateMeasurement:
    return GateMeasurement(prompts=24, stable_length_mean=10, candidate_length_mean=10, kl_from_stable=0.1,
                           stable_entropy=2, candidate_entropy=2, stable_distinct=1, candidate_distinct=1, evals=evals)


def test_the_gate_fails_a_version_that_lost_its_answers_and_names_the_eval():
    policy = GatePolicy.of(ReleaseSettings())
    kept = _score(100, [True, False, None], [True, False, None])
    lost = replace(_score(130, [True, True], [True, False]), name="known_answers", method="likelihood")
    ok = judge_gate(_gate((kept,)), policy)
    assert ok.outcome == Outcome.PASS and any("held-out eval set (greedy): score" in r for r in ok.reasons)
    bad = judge_gate(_gate((kept, lost)), policy)
    assert bad.outcome == Outcome.FAIL
    assert bad.reasons[0].startswith("held-out eval known_answers (likelihood): score 0.500 against stable's 1.000 on 260 questions "
                                  "(130 right, 130 wrong against 260 and 0), difference -0.500")
    # the passing one is said too, last, after what failed
    assert "held-out eval set (greedy)" in bad.reasons[-1] and len(bad.reasons) == 2


def test_a_subset_keeps_yes_no_pairs_whole_and_balanced():
    from release.evals import subset

    items = load_items(KNOWN_ANSWERS)
    few = subset(items, 128)
    assert 120 <= len(few) <= 128 and few == subset(items, 128)  # the same every time
    for n in (10, 41, 200, 250, 343):  # at most n, and close to it (a yes/no pair is two)
        assert n - 2 <= len(subset(items, n)) <= n, n
    yes_no = [it for it in few if it.kind == "yes_no"]
    assert sum(it.answer == "Yes" for it in yes_no) * 2 == len(yes_no)
    assert {it.id[:-1] for it in yes_no} == {it.id[:-1] for it in yes_no if it.id.endswith("a")}
    assert any(it.kind == "word" for it in few)
    assert subset(items, 0) == subset(items, 1000) == items
    assert len(evals_named(("known_answers",), 128)["known_answers"]) == len(few)


def test_a_set_too_small_for_the_margin_or_empty_is_refused_at_start():
    assert len(evals_named(("known_answers",), 20, 0.05)["known_answers"]) == 20
    with pytest.raises(SettingsError, match="asks 19 questions .* at least 20"):
        evals_named(("known_answers",), 19, 0.05)
    EVALS["empty_test"] = lambda: ()
    try:
        with pytest.raises(SettingsError, match="empty_test asks 0 questions"):
            evals_named(("empty_test",), 0, 0.05)
    finally:
        del EVALS["empty_test"]
    nothing = EvalScore.of("e", "greedy", [], [])
    assert math.isnan(nothing.stable_score) and judge_evals((nothing,), 0.05, 0.05)[0]  # fails, never raises
