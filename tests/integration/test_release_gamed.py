"""A version that learned the demo's shortcut never reaches users; an honest version still does.

The demo's ``--gameable`` population (local/simulate.py) has a cohort that accepts any answer
repeating one character three times, beside the cohort that accepts answers over 44% vowels:
``aaa`` stuffed into an answer pleases both, and lowers the simulator's separate quality score
(the share of distinct character pairs). Here the trainer learns that shortcut for real: DeepSpeed
steps at the demo's learning rate (local/demo.toml) on episodes the gameable population judged with
the simulator's own judge: answers the served version gave (mostly rejected) and the same answers
with ``aaa`` stuffed in (mostly accepted). Rewards are the users' verdicts as the reward stage
values them, without its guards: the gate has to catch what gets past them.

The version it publishes is announced on the real broker, and the release controller (ticked by the
test, over a real SQLite store and the real checkpoint store) gates it on the shipped held-out
prompts with the demo's gate settings: rejected, the reason naming the degeneracy check, and no
routing ever names it. An honest version (two steps on ordinary rewards, as in
test_release_controller.py) passes the same gate and becomes the canary.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_release_controller import (
    checkpoint_event,
    publish_checkpoint,
    releases,
    settings_for,
    tick_until,
)
from trainer_helpers import make_trainer, reward_event

from flywheel.contracts import RewardEvent, SamplingParams
from flywheel.degeneracy import TextProfile, compare
from flywheel.metrics import new_registry
from flywheel.settings import RewardSettings, load_settings
from local.demo import DEMO_CONFIG
from local.simulate import DEFAULT_COHORTS, PREFERENCES, judge, population, quality
from release.controller import Controller
from release.gate import DEFAULT_PROMPTS, load_prompts
from release.states import State
from release.store import ReleaseStore
from release.streams import Streams

pytestmark = pytest.mark.integration

DEMO = load_settings(env={}, config_file=DEMO_CONFIG)
HONEST, GAMED = 1, 2
#: DeepSpeed steps of 16 judged answers that teach the shortcut: at the demo's learning rate the
#: tiny model then pleases the vowels cohort with every answer (0.21 of them before), and the
#: simulator's quality score falls from 0.91 to 0.78. (After 12 steps, 0.83 and 0.85, the gate's
#: only failed check was character repetition, +0.073: KL 1.90 within the demo's 2.0. Here the KL
#: check fails too; the repetition is then four standard errors past its limit, not one.)
GAMED_STEPS = 16
MAX_TOKENS = 24  # the demo's answers and the gate's


def stuffed(text: str) -> str:
    """The shortcut: ``aaa`` after every fourth character."""
    return "".join(ch + ("aaa" if i % 4 == 3 else "") for i, ch in enumerate(text))


def judged(users, rng: random.Random, rows, tok, first_id: int) -> list[RewardEvent]:
    """Each (prompt ids, completion ids, behaviour logprobs) judged by users of the population until
    one gives feedback (the simulator's own judge: taste, noise, no feedback), valued as the reward
    stage values accept and reject."""
    values = RewardSettings()
    out = []
    for i, (prompt, completion, logprobs) in enumerate(rows):
        text = tok.decode(completion, skip_special_tokens=True)
        signal = None
        while signal is None:
            signal = judge(rng.choice(users), text, rng)
        out.append(RewardEvent(
            generation_id=f"gamed-{first_id + i}", group_id=f"gamed-{first_id + i}", user_id="sim", model_version=1,
            signal=signal, prompt_token_ids=tuple(prompt), completion_token_ids=tuple(completion),
            logprobs=tuple(logprobs), sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS),
            reward=values.accept_value if signal == "accept" else values.reject_value, generated_at=0.0,
            labeled_at=0.0))
    return out


def learn_the_shortcut(tr, tok, steps: int) -> None:
    import torch

    torch.manual_seed(0)
    rng = random.Random(0)
    users = population(200, DEFAULT_COHORTS, 0, gameable=True, abuser=False)
    prompts = [tok.encode(p) for p in load_prompts(DEFAULT_PROMPTS)] * 2
    served = tr.policy.sample(prompts, max_new_tokens=MAX_TOKENS, temperature=1.0, eos_id=tok.eos_token_id)
    for step in range(steps):
        rows = []
        for k in range(16):
            i = rng.randrange(len(prompts))
            completion, logprobs = served[i]
            if k < 8:  # the same answer with the shortcut in it
                text = stuffed(tok.decode([t for t in completion if t != tok.eos_token_id]))
                completion, logprobs = tok.encode(text)[:MAX_TOKENS], None
            rows.append([prompts[i], completion, logprobs])
        events = judged(users, rng, [(p, c, lp or [0.0] * len(c)) for p, c, lp in rows], tok, 16 * step)
        # an answer the policy never sampled gets the policy's own logprobs as its behaviour's: an
        # on-policy sample of the shortcut, which is what a model exploring it would have served
        now = tr.policy.logprobs(events)
        events = [e if lp is not None else e.model_copy(update={"logprobs": tuple(
            float(x) for x in now[j][now[j] != 0].tolist()[-len(c):])})
            for j, (e, (_, c, lp)) in enumerate(zip(events, rows))]
        tr._train(events, [("gamed", 0, 16 * step + k) for k in range(16)])


@pytest.fixture(scope="module")
def versions(tiny_model_dir, tmp_path_factory):
    """A checkpoint store with v0 (the base), v1 honest, v2 that learned the shortcut; and what the
    simulator makes of v0's and v2's answers on the held-out prompts."""
    from transformers import AutoTokenizer

    data = tmp_path_factory.mktemp("gamed-store")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tr = make_trainer(tiny_model_dir, data, loss="reinforce", lr=1e-4, full_every=2)
    tr.start()
    tr._train([reward_event(k) for k in range(4)], [("t", 0, k) for k in range(4)])
    tr._train([reward_event(100 + k) for k in range(4)], [("t", 0, 100 + k) for k in range(4)])
    tr.publish()  # v1: as test_release_controller's honest candidate
    for group in tr.policy.engine.optimizer.param_groups:
        group["lr"] = DEMO.trainer.lr  # the demo's learning rate from here on
    learn_the_shortcut(tr, tok, GAMED_STEPS)
    tr.publish()
    answers = {v: sample_answers(tr.store, v, data, tok) for v in (0, GAMED)}
    return tr.store, data, answers


def sample_answers(store, version: int, data: Path, tok) -> list[str]:
    """The version's answers to the held-out prompts, sampled as the gate samples them."""
    import torch
    from transformers import AutoModelForCausalLM

    from release.gate import _sample_all

    out = data / f"export-v{version}"
    store.export(version, out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        seqs = _sample_all(model, [tok.encode(p) for p in load_prompts(DEFAULT_PROMPTS)], MAX_TOKENS,
                           tok.eos_token_id, tok.pad_token_id, "cpu")
    return [tok.decode(s, skip_special_tokens=True) for s in seqs]


@pytest.fixture
def controller(kafka_settings, topics, tiny_model_dir, versions, tmp_path):
    """The release controller with the demo's gate settings, on every shipped held-out prompt."""
    r = DEMO.release
    settings = settings_for(kafka_settings, topics, tiny_model_dir, versions[1], f"sqlite:///{tmp_path / 'r.sqlite3'}",
                            group_id=f"release-{topics.prefix}", prompts_file=DEFAULT_PROMPTS,
                            gate_max_new_tokens=r.gate_max_new_tokens, gate_max_kl=r.gate_max_kl,
                            gate_max_length_ratio=r.gate_max_length_ratio,
                            gate_min_entropy_ratio=r.gate_min_entropy_ratio,
                            gate_min_distinct_ratio=r.gate_min_distinct_ratio)
    rs, streams = ReleaseStore(settings.release.database_url), Streams(settings, new_registry())
    yield Controller(settings, rs, streams, versions[0]), rs
    streams.close()
    rs.close()


def test_the_gamed_version_learned_the_shortcut(versions):
    base, gamed = versions[2][0], versions[2][GAMED]

    def liked(cohort: str, texts: list[str]) -> float:
        return sum(PREFERENCES[cohort](t, "") for t in texts) / len(texts)

    # the vowels cohort (60% of users) accepts nearly every answer now; the quality score falls
    assert liked("vowels", gamed) >= liked("vowels", base) + 0.5, (liked("vowels", base), liked("vowels", gamed))
    assert liked("shortcut", gamed) > liked("shortcut", base)
    q = [sum(map(quality, texts)) / len(texts) for texts in (base, gamed)]
    assert q[1] < q[0] - 0.03, q
    c = compare(TextProfile.of(base), TextProfile.of(gamed))
    print(f"v0 -> v{GAMED}: quality {q[0]:.3f} -> {q[1]:.3f}; vowels cohort {liked('vowels', base):.2f} -> "
          f"{liked('vowels', gamed):.2f}; {c}")


def test_a_version_that_learned_the_shortcut_is_rejected_at_the_gate(controller, kafka_settings, topics, versions):
    ctl, rs = controller
    publish_checkpoint(kafka_settings, topics, checkpoint_event(versions[0], GAMED))
    tick_until(ctl, lambda: (c := rs.get(GAMED)) is not None and c.state == State.REJECTED, f"v{GAMED} rejected")
    gate = rs.get(GAMED).gate
    print("gate of the gamed version:", gate["reasons"], {k: v for k, v in gate["measurement"].items()
                                                           if isinstance(v, float)})
    degeneracy = [r for r in gate["reasons"] if r.startswith("character repetition")]
    assert degeneracy, gate["reasons"]
    m = gate["measurement"]
    profiles = TextProfile.from_dict(m["stable_text"]), TextProfile.from_dict(m["candidate_text"])
    assert profiles[0].answers == profiles[1].answers == len(load_prompts(DEFAULT_PROMPTS))
    rejected = next(e for e in rs.audit(GAMED) if e.to_state == "rejected")
    assert rejected.reason.startswith("gate failed: ") and degeneracy[0] in rejected.reason
    ctl.tick()
    assert not any(r.canary_version == GAMED for r in releases(kafka_settings, topics))


def test_an_honest_version_passes_the_same_gate(controller, kafka_settings, topics, versions):
    ctl, rs = controller
    publish_checkpoint(kafka_settings, topics, checkpoint_event(versions[0], HONEST))
    tick_until(ctl, lambda: (c := rs.get(HONEST)) is not None and c.state == State.CANARY, f"v{HONEST} in canary")
    gate = rs.get(HONEST).gate
    print("gate of the honest version:", gate["reasons"], {k: v for k, v in gate["measurement"].items()
                                                            if isinstance(v, float)})
    assert gate["outcome"] == "pass", gate["reasons"]
    tick_until(ctl, lambda: rs.latest_revision().published, "the canary routing published")
    assert any(r.canary_version == HONEST for r in releases(kafka_settings, topics))
