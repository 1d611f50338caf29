"""The real-model demo's pure parts: the yes/no taste (local/simulate.py), the answer timeline of
the report (local/report.py) and the settings laid over demo.toml (local/demo.py)."""

from __future__ import annotations

import json
import random
import tomllib

import pytest

from flywheel.settings import load_settings
from local.demo import BUILT, DEMO_CONFIG, REAL, merged_config, to_toml
from local.report import answer_timeline, column_title
from local.simulate import TASTES, YES_NO_HELD_OUT, YES_NO_PROMPTS, judge, population, starts_yes_no


@pytest.mark.parametrize(("text", "direct"), [
    ("Yes, the sun is a star.", True),
    ("No. Penguins cannot fly.", True),
    ("yes", True),
    ("NO!", True),
    ("  \nYes it is", True),  # leading whitespace
    ('"No," said the model', True),  # quoted
    ("**Yes**, it is", True),  # emphasis
    ("- No, they are birds", True),  # a list mark
    ("Yes-ish", True),  # a word ends at a hyphen: it still answered first
    ("Yesterday it rained", False),  # another word that starts the same
    ("Nobody knows", False),
    ("Now, about penguins", False),
    ("No1 is the best", False),
    ("Nope.", False),  # not a direct "No"
    ("The answer is yes.", False),  # yes, but not first
    ("Absolutely.", False),
    ("", False),
    ("   ", False),
    ("No no no no no no no no", False),  # collapsed, not an answer
    ("No. No. No. No. No.", False),
    ("Yes yes", True),  # too short to call repeated
    ("No, no, penguins cannot fly at all.", True),  # a repeat among distinct words
])
def test_the_yes_no_taste_wants_a_direct_yes_or_no_first(text, direct):
    assert starts_yes_no(text) is direct


def test_yes_no_users_ask_yes_no_questions_through_chat_and_judge_by_the_first_word():
    taste = TASTES["yes_no"]
    assert taste.chat and taste.prompts == YES_NO_PROMPTS and all(p.endswith("?") for p in YES_NO_PROMPTS)
    users = population(200, taste.cohorts, seed=1, gameable=False, abuser=True)
    assert {u.cohort.name for u in users[:-1]} == {"direct"} and users[-1].cohort is None
    rng = random.Random(0)
    yes = [s for s in (judge(users[0], "Yes, it is.", rng) for _ in range(1000)) if s]
    other = [s for s in (judge(users[0], "The sun is a star.", rng) for _ in range(1000)) if s]
    assert 0.9 < yes.count("accept") / len(yes) and other.count("accept") / len(other) < 0.1  # noise 0.05
    assert TASTES["built"].chat is False and TASTES["built"].prompts is None  # the built demo as it was


T0 = 1000.0
PROMPTS = ["Is the sun a star?", "Can penguins fly?"]


def test_the_timeline_shows_the_start_each_promotion_and_the_newest_with_accept_rates():
    answers = {"prompts": PROMPTS, "preference": "yes_no", "newest": 5,
               "by_version": {0: ["The sun is a ball of gas.", "Penguins are birds."],
                              2: ["Yes, the sun is a star.", "Penguins are birds."],
                              4: ["Yes, it is.", "No, they cannot."],
                              5: ["Yes.", "No."]}}
    promoted = [{"version": 2, "at": T0 + 100.0}, {"version": 4, "at": T0 + 250.0}]
    versions = {0: {"accept_rate": 0.15, "judged": 300}, 2: {"accept_rate": 0.4, "judged": 120},
                4: {"accept_rate": 0.7, "judged": 90}}
    got = answer_timeline(answers, promoted, versions, T0)
    assert [(c["version"], c["role"], c["after_s"]) for c in got] == [
        (0, "start", None), (2, "promoted", 100.0), (4, "promoted", 250.0), (5, "newest, never promoted", None)]
    assert [c["accept_rate"] for c in got] == [0.15, 0.4, 0.7, None] and got[-1]["judged"] == 0
    assert [[a["liked"] for a in c["answers"]] for c in got] == [[False, False], [True, False], [True, True],
                                                                 [True, True]]
    assert got[1]["answers"][0] == {"prompt": PROMPTS[0], "text": "Yes, the sun is a star.", "liked": True}
    assert column_title(got[1]) == "v2, promoted after 100 s: accept rate 0.40 over 120 judged"
    assert column_title(got[0]).startswith("v0, at the start: accept rate 0.15")
    assert column_title(got[-1]) == "v5, newest, never promoted: no user judged its answers"


def test_the_timeline_leaves_out_what_was_not_answered_and_repeats_no_version():
    answers = {"prompts": PROMPTS, "preference": "yes_no", "newest": 3,
               "by_version": {0: ["a", "b"], 3: ["Yes", "No"]}}  # v2's checkpoint could not be read
    promoted = [{"version": 2, "at": T0 + 10}, {"version": 3, "at": T0 + 20}]
    got = answer_timeline(answers, promoted, {}, T0)
    assert [c["version"] for c in got] == [0, 3] and got[1]["role"] == "promoted"  # the newest, once
    assert answer_timeline(None, promoted, {}, T0) == []  # the built model: no answers


def test_the_real_models_settings_are_demo_toml_with_the_overlay_and_training_mode(tmp_path):
    lora = load_settings(env={}, config_file=merged_config(REAL, "lora", tmp_path / "lora.toml"))
    full = load_settings(env={}, config_file=merged_config(REAL, "full", tmp_path / "full.toml"))
    base = load_settings(env={}, config_file=DEMO_CONFIG)
    overlay = tomllib.loads(REAL.overlay.read_text())
    assert lora.trainer.lora_rank == overlay["trainer"]["lora_rank"] > 0 and lora.trainer.lr == overlay["trainer"]["lr"]
    assert full.trainer.lora_rank == 0 and full.trainer.lr < lora.trainer.lr
    # what the overlay leaves alone is demo.toml's
    assert lora.ingest == base.ingest and lora.release.canary_share == base.release.canary_share
    assert lora.release.deadline_s == overlay["release"]["deadline_s"]
    assert merged_config(BUILT, None, tmp_path / "built.toml") == DEMO_CONFIG  # the built demo as it was
    # the gate's held-out prompts are questions of the users' kind that no user asks
    gate = [json.loads(line)["prompt"] for line in lora.release.prompts_file.read_text().splitlines()]
    assert gate == list(YES_NO_HELD_OUT) and not set(gate) & set(YES_NO_PROMPTS)
    assert REAL.fixed_prompts[-1] in gate and set(REAL.fixed_prompts[:-1]) <= set(YES_NO_PROMPTS)


def test_settings_written_as_toml_read_back_the_same():
    data = {"a": 1, "trainer": {"lr": 2e-3, "lora_target_modules": ["q_proj", "v_proj"], "loss": 'say "hi"',
                                "on": True}, "serve": {"x": {"y": 0.5}}}
    assert tomllib.loads(to_toml(data)) == data


def test_knowing_users_run_on_a_real_model_only_with_the_same_settings(tmp_path):
    from types import SimpleNamespace

    from local.demo import KNOWING, choose
    from local.simulate import TASTES, known_answers

    args = SimpleNamespace(knowing=True, model="built", model_dir=tmp_path)
    assert choose(load_settings(env={}, config_file=DEMO_CONFIG), args) == (KNOWING, tmp_path)
    with pytest.raises(SystemExit, match="--knowing is for a real model"):
        choose(load_settings(env={}, config_file=DEMO_CONFIG), SimpleNamespace(knowing=True, model="built"))
    assert KNOWING.taste == "known" and KNOWING.overlay == REAL.overlay
    # two answers a question, each judged: GRPO compares them (a group of 2 per request)
    # (two answers a question at 1 request/s: 2 answers/s, one prefill a pair)
    assert TASTES["known"].choices == 2 and KNOWING.rate < REAL.rate
    # the fixed prompts: three the users ask (with known answers), and the gate's question no user asks
    assert set(KNOWING.fixed_prompts[:-1]) <= set(known_answers()) and KNOWING.fixed_prompts[-1] in YES_NO_HELD_OUT
    settings = load_settings(env={}, config_file=merged_config(KNOWING, None, tmp_path / "knowing.toml"))
    real = load_settings(env={}, config_file=merged_config(REAL, "full", tmp_path / "real.toml"))
    # whole weights by default; the grouped loss over full groups of two
    assert settings.trainer.lora_rank == 0 and settings.trainer.lr > real.trainer.lr
    assert (settings.trainer.loss, settings.trainer.group_size, settings.trainer.active_sampling) == ("grpo", 2, True)
    assert settings.trainer == real.trainer.model_copy(update={"lr": settings.trainer.lr, "loss": "grpo",
                                                               "group_size": 2})
    assert settings == real.model_copy(update={"release": settings.release, "trainer": settings.trainer})
    # a longer canary (a smaller lift to show); every held-out question still asked
    assert settings.release.deadline_s > real.release.deadline_s and settings.release.eval_questions == 0
    assert settings.release == real.release.model_copy(update={"prompts_file": settings.release.prompts_file,
                                                               "deadline_s": settings.release.deadline_s})
    # --training lora still trains an adapter, with the same grouped loss
    lora = load_settings(env={}, config_file=merged_config(KNOWING, "lora", tmp_path / "knowing-lora.toml"))
    assert lora.trainer.lora_rank == 8 and lora.trainer.loss == "grpo"
    assert not set(TASTES["known"].prompts) & set(YES_NO_HELD_OUT)
