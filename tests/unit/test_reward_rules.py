"""Table tests for the reward labelers and guards (reward/labelers.py, reward/guards.py)."""

from __future__ import annotations

import uuid

import pytest

from flywheel.contracts import EpisodeEvent, GenerationEvent, SamplingParams
from flywheel.settings import RewardSettings, SettingsError
from reward.guards import UserWindow, distinct_ngram_ratio, judge_sample, judge_user, length_penalty
from reward.labelers import (
    LabelerError,
    build_labeler,
    edit_similarity,
    edit_value,
    latency_value,
    register_labeler,
    register_reward_model,
    register_verifier,
    signal_value,
)

CFG = RewardSettings()


def episode(signal="accept", text="hello world", edited=None, ms=None, tokens=(1, 2, 3)) -> EpisodeEvent:
    g = GenerationEvent(
        generation_id="g", group_id="g", model_name="m", model_version=0, user_id="u", endpoint="chat",
        created_at=1, completed_at=1, latency_ms=1, prompt_text="p", prompt_token_ids=(1,),
        completion_text=text, completion_token_ids=tokens, logprobs=tuple(-1.0 for _ in tokens),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")
    return EpisodeEvent(generation=g, signal=signal, edited_text=edited, decision_ms=ms, resolved_at=2)


@pytest.mark.parametrize("signal, value", [("accept", 0.75), ("reject", -0.25), ("ignore", 0.0), ("edit", None)])
def test_signal_value_asymmetric_defaults(signal, value):
    assert signal_value(signal, CFG) == value


SYMMETRIC = RewardSettings(accept_value=1.0, reject_value=-1.0, ignore_value=-0.1, latency_bonus=0.2,
                           latency_ref_ms=1000)


@pytest.mark.parametrize("ep, components", [
    (episode("accept", ms=500), {"signal": 1.0, "latency": 0.1}),
    (episode("reject", ms=0), {"signal": -1.0, "latency": -0.2}),
    (episode("ignore"), {"signal": -0.1}),
    (episode("edit", text="abcd", edited="abcx"), {"edit": 0.5}),  # -1 + 2 x 0.75
])
def test_configured_values_flow_through_the_composed_labeler(ep, components):
    """The scheme is the operator's: nothing may assume the default +0.75 / -0.25."""
    assert build_labeler(SYMMETRIC)(ep) == pytest.approx(components)


@pytest.mark.parametrize("a, b, sim", [("abcd", "abcd", 1.0), ("abcd", "abcx", 0.75), ("abcd", "", 0.0),
                                       ("", "", 1.0), ("kitten", "sitting", 1 - 3 / 7)])
def test_edit_similarity(a, b, sim):
    assert edit_similarity(a, b) == pytest.approx(sim)


@pytest.mark.parametrize("a, b, cap, sim", [
    ("kitten", "sitting", 7, 1 - 3 / 7),  # within the cap: exact
    ("kitten", "sitting", 6, 1 - 3 / 6),  # prefixes "kitten"/"sittin" 2 edits of 6, suffixes "itting" 3
    ("abc", "abc" + "z" * 997, 10, 0.0),  # a huge edit of a short text: its tail window is all new
    ("ab" * 500, "ab" * 500, 10, 1.0),  # long and identical
    ("ab" * 500, "ab" * 499 + "xy", 10, 1 - 2 / 10),  # differs past the prefixes: the tails see it
    ("x" * 30, "x" * 20 + "y" * 10, 20, 1 - 10 / 20),  # the tail rewritten: judged on its window
    ("ab" * 15, "ab" * 10, 20, 20 / 30),  # the tail deleted: the length ratio
    ("ab" * 15, "y" * 10 + "ab" * 10, 20, 1 - 10 / 20),  # the head rewritten: judged on its window
    ("ab" * 500, "ab" * 250 + "xy" + "ab" * 249, 10, 1.0),  # differs in the middle only: unseen
])
def test_edit_similarity_of_long_texts_is_bounded(a, b, cap, sim):
    assert edit_similarity(a, b, cap) == pytest.approx(sim)


@pytest.mark.parametrize("sim, value", [(1.0, 0.75), (0.0, -0.25), (0.5, 0.25)])
def test_edit_value_interpolates_reject_to_accept(sim, value):
    assert edit_value(sim, CFG) == pytest.approx(value)


@pytest.mark.parametrize("signal, ms, value", [
    ("accept", 0.0, 0.05), ("accept", 5000.0, 0.025), ("accept", 20000.0, 0.0),
    ("reject", 0.0, -0.05), ("edit", 0.0, 0.0), ("accept", None, 0.0)])
def test_latency_value(signal, ms, value):
    assert latency_value(signal, ms, CFG) == pytest.approx(value)


@pytest.mark.parametrize("ep, components", [
    (episode("accept", ms=5000), {"signal": 0.75, "latency": 0.025}),
    (episode("reject"), {"signal": -0.25}),
    (episode("edit", text="abcd", edited="abcx"), {"edit": 0.5}),
    (episode("ignore"), {"signal": 0.0}),
])
def test_composed_labeler(ep, components):
    assert build_labeler(CFG)(ep) == pytest.approx(components)


def test_verifier_and_reward_model_hooks():
    class Model:
        def score(self, prompt: str, completion: str) -> float:
            return len(completion) / 10

    register_verifier("says_hello", lambda ep: 1.0 if "hello" in ep.generation.completion_text else None)
    register_reward_model("len", lambda cfg: Model())
    label = build_labeler(RewardSettings(labelers=("signal", "verifier:says_hello", "reward_model:len",
                                                   "verifier:nonempty")))
    assert label(episode("reject")) == pytest.approx({"signal": -0.25, "verifier_says_hello": 1.0, "rm_len": 1.1})
    assert label(episode("accept", text=" "))["verifier_nonempty"] == -1.0


def test_unknown_labeler_fails_at_start():
    with pytest.raises(SettingsError, match="unknown labeler 'nope'.*reward.plugins"):
        build_labeler(RewardSettings(labelers=("signal", "nope")))


def plugin(tmp_path, monkeypatch, source: str) -> str:
    """A module of the user's, importable by the name returned (unique per test)."""
    name = f"flyplug_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_plugins_register_the_users_verifiers_before_labelers_are_looked_up(tmp_path, monkeypatch):
    mod = plugin(tmp_path, monkeypatch, (
        "from reward.labelers import register_verifier\n"
        "register_verifier('starts_x', lambda ep: 1.0 if ep.generation.completion_text.startswith('x') else None)\n"))
    label = build_labeler(RewardSettings(plugins=(mod,), labelers=("signal", "verifier:starts_x")))
    assert label(episode(text="xyz")) == {"signal": 0.75, "verifier_starts_x": 1.0}
    assert label(episode(text="abc")) == {"signal": 0.75}


@pytest.mark.parametrize(("source", "reason"), [
    (None, "ModuleNotFoundError"),
    ("raise RuntimeError('no credentials for the scorer')", "RuntimeError: no credentials for the scorer"),
    ("def broken(:\n", "SyntaxError"),
])
def test_a_plugin_that_cannot_be_imported_stops_the_stage_with_the_reason(tmp_path, monkeypatch, source, reason):
    mod = plugin(tmp_path, monkeypatch, source) if source else "flyplug_missing_module"
    with pytest.raises(SettingsError, match=f"reward.plugins: cannot import '{mod}': {reason}"):
        build_labeler(RewardSettings(plugins=(mod,), labelers=("signal",)))


def test_components_become_plain_floats_whatever_number_type_a_labeler_returns():
    import numpy as np

    name = f"l{uuid.uuid4().hex[:6]}"
    register_labeler(name)(lambda cfg: lambda ep: {"np32": np.float32(0.5), "np64": np.float64(-1.0), "int": 2,
                                                   "npint": np.int64(3)})
    got = build_labeler(RewardSettings(labelers=(name,)))(episode())
    assert got == {"np32": 0.5, "np64": -1.0, "int": 2.0, "npint": 3.0} and all(type(v) is float for v in got.values())
    bad = f"l{uuid.uuid4().hex[:6]}"
    register_labeler(bad)(lambda cfg: lambda ep: {"x": None})
    with pytest.raises(LabelerError, match="component 'x' is None, not a finite number"):
        build_labeler(RewardSettings(labelers=(bad,)))(episode())


@pytest.mark.parametrize(("fn", "detail"), [
    (lambda ep: 1 / 0, "labeler 'verifier:{}': ZeroDivisionError: division by zero"),
    (lambda ep: float("nan"), "labeler 'verifier:{}': component 'verifier_{}' is nan, not a finite number"),
    (lambda ep: float("-inf"), "labeler 'verifier:{}': component 'verifier_{}' is -inf, not a finite number"),
    (lambda ep: "high", "labeler 'verifier:{}': component 'verifier_{}' is 'high', not a finite number"),
    (lambda ep: True, "labeler 'verifier:{}': component 'verifier_{}' is True, not a finite number"),
])
def test_a_failing_labeler_fails_the_episode_naming_itself(fn, detail):
    name = f"v{uuid.uuid4().hex[:6]}"
    register_verifier(name, fn)
    label = build_labeler(RewardSettings(labelers=("signal", f"verifier:{name}")))
    with pytest.raises(LabelerError) as exc:
        label(episode())
    assert str(exc.value) == detail.format(name, name)


@pytest.mark.parametrize(("output", "detail"), [
    (None, "returned NoneType, not a dict of components"),
    ([("x", 1.0)], "returned list, not a dict of components"),
    ({"x": 10**400}, "component 'x' is " + str(10**400) + ", not a finite number"),  # past float's range
    ({("a", 1): 0.5}, "component name ('a', 1) is not a str that UTF-8 can encode"),
    ({None: 0.5}, "component name None is not a str that UTF-8 can encode"),
    ({"score_\ud800": 1.0}, "component name 'score_\\ud800' is not a str that UTF-8 can encode"),
    ({"length_penalty": 0.5}, "component name 'length_penalty' is the reward guards' own"),
    ({"x": "0.5"}, "component 'x' is '0.5', not a finite number"),  # float() would take these three
    ({"x": b"1"}, "component 'x' is b'1', not a finite number"),
    ({"x": True}, "component 'x' is True, not a finite number"),
    ({"signal": 0.5}, "component 'signal' was given by labeler 'signal' already"),
], ids=["none", "list", "huge-int", "tuple-key", "none-key", "surrogate-key", "guard-name", "str", "bytes",
        "bool", "another-labelers-name"])
def test_a_labelers_output_the_reward_cannot_carry_fails_the_episode(output, detail):
    """Each of these once passed the labeler's checks and crashed the stage on the next step
    (reading the dict, converting the number, encoding the record), batch after batch."""
    name = f"l{uuid.uuid4().hex[:6]}"
    register_labeler(name)(lambda cfg: lambda ep: output)
    with pytest.raises(LabelerError) as exc:
        build_labeler(RewardSettings(labelers=("signal", name)))(episode())
    assert str(exc.value) == f"labeler {name!r}: {detail}"


def test_a_labeler_may_score_with_any_type_of_number():
    """A reward model returns what its framework computes: numpy scalars, a tensor of one value."""
    from decimal import Decimal

    import numpy as np
    import torch

    name = f"l{uuid.uuid4().hex[:6]}"
    register_labeler(name)(lambda cfg: lambda ep: {"a": np.float32(0.5), "b": np.int64(2), "c": Decimal("0.25"),
                                                   "d": torch.tensor(-1.0)})
    got = build_labeler(RewardSettings(labelers=(name,)))(episode())
    assert got == {"a": 0.5, "b": 2.0, "c": 0.25, "d": -1.0} and all(type(v) is float for v in got.values())
    register_labeler(name + "x")(lambda cfg: lambda ep: {"t": torch.tensor([1.0, 2.0])})
    with pytest.raises(LabelerError, match="component 't' is tensor"):
        build_labeler(RewardSettings(labelers=(name + "x",)))(episode())


def test_a_component_two_labelers_give_fails_the_episode_naming_both():
    """Kept, the later one replaced the earlier: a plugin's ``signal`` silently took the place of
    the user's signal in the reward."""
    a, b = (f"l{uuid.uuid4().hex[:6]}" for _ in range(2))
    register_labeler(a)(lambda cfg: lambda ep: {"politeness": 0.5, "score": 1.0})
    register_labeler(b)(lambda cfg: lambda ep: {"score": 0.25} if ep.signal == "reject" else {})
    label = build_labeler(RewardSettings(labelers=("signal", a, b)))
    assert label(episode("accept")) == {"signal": 0.75, "politeness": 0.5, "score": 1.0}
    with pytest.raises(LabelerError) as exc:
        label(episode("reject"))
    assert str(exc.value) == f"labeler {b!r}: component 'score' was given by labeler {a!r} already"


def test_a_labeler_named_twice_stops_the_stage_at_start():
    """Each episode would give its components twice: counted once, the config was not what it
    said (("signal", "signal") labeled an accept 0.75, not 1.5); failed, every episode would be
    dead-lettered."""
    with pytest.raises(SettingsError) as exc:
        build_labeler(RewardSettings(labelers=("signal", "edit", "signal", "latency", "edit")))
    assert str(exc.value) == ("reward.labelers: 'edit', 'signal' named more than once; "
                              "each labeler's components count once")


def test_finite_components_that_add_up_to_infinity_fail_the_episode():
    a, b = (f"v{uuid.uuid4().hex[:6]}" for _ in range(2))
    register_verifier(a, lambda ep: 1e308)
    register_verifier(b, lambda ep: 1e308)
    label = build_labeler(RewardSettings(labelers=("signal", f"verifier:{a}", f"verifier:{b}")))
    with pytest.raises(LabelerError) as exc:
        label(episode())
    assert str(exc.value) == (f"labeler 'signal + verifier:{a} + verifier:{b}': "
                              "components add up to inf, not a finite reward")
    register_verifier(b, lambda ep: -1e308)  # huge but finite in sum: labeled
    label = build_labeler(RewardSettings(labelers=("signal", f"verifier:{a}", f"verifier:{b}")))
    assert label(episode()) == {"signal": 0.75, f"verifier_{a}": 1e308, f"verifier_{b}": -1e308}


# -- guards -------------------------------------------------------------------------------
G = RewardSettings(user_cap_share=0.2, user_cap_min=5, constant_min_signals=4, constant_weight=0.2,
                   rate_factor=3.0, rate_min=10, rate_weight=0.5)


@pytest.mark.parametrize("stats, weight, flags", [
    (UserWindow(3, 2, 10, 5, {"accept": 2, "reject": 1}, 9), 1.0, ()),
    (UserWindow(6, 5, 10, 5, {"accept": 3, "reject": 3}, 9), 0.0, ("user_cap",)),       # 6th kept > max(5, 2)
    (UserWindow(9, 4, 10, 5, {"accept": 4, "reject": 5}, 9), 1.0, ()),                  # capped ones do not count
    (UserWindow(6, 5, 100, 20, {"accept": 3, "reject": 3}, 99), 1.0, ()),               # within 20%
    (UserWindow(50, 19, 200, 10, {"accept": 25, "reject": 25}, 60), 0.0, ("user_cap",)),  # 20 > 20% of 61 kept
    (UserWindow(50, 11, 200, 10, {"accept": 25, "reject": 25}, 60), 1.0, ()),           # 12 of 61 kept: within
    (UserWindow(4, 3, 100, 50, {"accept": 4}, 99), 0.2, ("constant_user",)),            # accepts everything
    (UserWindow(3, 2, 100, 50, {"accept": 3}, 99), 1.0, ()),                            # too few to judge
    (UserWindow(4, 3, 100, 50, {"edit": 4}, 99), 1.0, ()),                              # edits are graded
    (UserWindow(4, 3, 100, 50, {"reject": 4}, 99), 0.2, ("constant_user",)),            # rejects everything
    (UserWindow(12, 11, 100, 50, {"accept": 6, "reject": 6}, 99), 0.5, ("rate_anomaly",)),  # 12 > 3 x 88/49
    (UserWindow(10, 4, 13, 2, {"accept": 5, "reject": 5}, 12), 0.5, ("rate_anomaly",)),  # 10 > 3 x the other's 3
    (UserWindow(10, 4, 10, 1, {"accept": 5, "reject": 5}, 9), 1.0, ()),                 # alone: no one to compare with
    (UserWindow(30, 20, 100, 20, {"accept": 30}, 99), 0.0, ("user_cap", "constant_user", "rate_anomaly")),
])
def test_judge_user(stats, weight, flags):
    v = judge_user(stats, G)
    assert (v.weight, v.flags) == (pytest.approx(weight), flags)


@pytest.mark.parametrize("every", [2, 20])  # half the traffic, and 95% of it
def test_flooding_user_share_is_capped(every):
    """A flooding user owns at most their share (20%) of the samples the window keeps, however
    much of the traffic they send; measured against all samples, 95% of them bought 80% of the
    kept ones."""
    counts: dict[str, int] = {}
    kept: dict[str, int] = {}
    users = 0
    for i in range(4000):
        user = f"u{i % 37}" if i % every == 0 else "flood"
        counts.setdefault(user, 0)
        users += counts[user] == 0
        counts[user] += 1
        stats = UserWindow(counts[user], kept.get(user, 0), i + 1, users, {"accept": 1, "reject": 1},
                           sum(kept.values()))
        kept[user] = kept.get(user, 0) + (judge_user(stats, G).weight > 0)
    # at most a fifth of the kept samples, and close to it: not over-capped
    assert counts["flood"] == 4000 - 4000 // every
    assert 0.19 * sum(kept.values()) <= kept["flood"] <= 0.2 * sum(kept.values())


def test_constant_accept_user_is_flagged_and_down_weighted():
    weights = [judge_user(UserWindow(n, n - 1, 10 * n, 20, {"accept": n}, 10 * n - 1), G).weight for n in range(1, 8)]
    assert weights[:3] == [1.0, 1.0, 1.0] and all(w == pytest.approx(0.2) for w in weights[3:])


@pytest.mark.parametrize("n, penalty", [
    (10, 0.0), (256, 0.0), (512, -0.1), (384, -0.05),
    (256 * 11, -1.0), (256 * 11 + 1, -1.0), (10**7, -1.0),  # capped at length_penalty_max
])
def test_length_penalty(n, penalty):
    assert length_penalty(n, CFG) == pytest.approx(penalty)


def test_length_penalty_cap_is_a_setting():
    cfg = RewardSettings(length_penalty_max=0.25)
    assert [length_penalty(n, cfg) for n in (384, 1024, 10**6)] == pytest.approx([-0.05, -0.25, -0.25])
    assert length_penalty(10**6, RewardSettings(length_penalty=0)) == 0.0


@pytest.mark.parametrize("tokens, ratio", [((1, 2, 3, 4), 1.0), ((7,) * 10, 1 / 8), ((1, 2), 1.0), ((1, 2, 1, 2, 1, 2), 0.5)])
def test_distinct_ngram_ratio(tokens, ratio):
    assert distinct_ngram_ratio(tokens, 3) == pytest.approx(ratio)


@pytest.mark.parametrize("tokens, components, flags", [
    (tuple(range(20)), {}, ()),
    ((5,) * 20, {"repetition_penalty": -0.5}, ("repetition",)),
    ((5,) * 10, {}, ()),  # too short to judge
    (tuple(range(512)), {"length_penalty": -0.1}, ("long",)),
    (tuple(range(256)), {}, ()),  # at the target: not long
])
def test_judge_sample(tokens, components, flags):
    assert judge_sample(tokens, CFG) == (pytest.approx(components), flags)


@pytest.mark.parametrize("tokens, text, flags", [
    ((5, 6, 7), "aaaaaaaa", ("repetition",)),  # three tokens of one letter: the token guard waits for 16
    ((5, 6, 7, 8), "aaa eee ooo", ("repetition",)),  # what the demo's shortcut cohort accepts
    ((5, 6, 7, 8), "hahahahaha", ("repetition",)),
    ((5, 6, 7, 8, 9, 10), "the cat sat on the mat", ()),  # short natural text
    ((5, 6, 7, 8), "Hello there", ()),
    ((5, 6), "aaaaaaa", ()),  # under repetition_min_chars: too short to judge
    (tuple(range(20)), "ab" * 40, ("repetition",)),  # distinct tokens, one pair of characters over and over
    ((5,) * 20, "a" * 20, ("repetition",)),  # both say so: flagged once
])
def test_judge_sample_catches_short_degenerate_text_by_its_characters(tokens, text, flags):
    assert judge_sample(tokens, CFG, text) == (pytest.approx({"repetition_penalty": -0.5} if flags else {}), flags)


def test_a_guard_whose_penalty_is_off_still_flags():
    """A penalty of 0 stops the reward paying for it; the guard still says what it saw, so the
    hacking alert and the report keep seeing long and degenerate completions."""
    off = RewardSettings(length_penalty=0, repetition_penalty=0)
    assert judge_sample(tuple(range(5000)), off) == ({}, ("long",))
    assert judge_sample((5,) * 20, off) == ({}, ("repetition",))


# -- the stage's guard counts: cached in memory, exact across rollbacks and restarts ----------
def _record(ep: EpisodeEvent, offset: int, partition: int = 0):
    """``ep`` as the reward stage reads it from the episodes topic."""
    from kafka.consumer.fetcher import ConsumerRecord

    from flywheel.contracts import encode

    value = encode(ep)
    return ConsumerRecord(topic="e", partition=partition, leader_epoch=-1, offset=offset, timestamp=0,
                          timestamp_type=0, key=ep.generation_id.encode(), value=value, headers=[], checksum=None,
                          serialized_key_size=0, serialized_value_size=len(value), serialized_header_size=0)


def _records(n: int) -> list:
    out = []
    for i in range(n):
        g = episode().generation.model_copy(update={"generation_id": f"g{i}", "user_id": "flood" if i % 2 else f"u{i % 5}"})
        out.append(_record(EpisodeEvent(generation=g, signal=("accept", "reject")[i % 3 == 0], resolved_at=2), i))
    return out


def _rewards(tmp_path, name: str, batches: list[list], fail_at: int | None = None) -> list[tuple]:
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import RewardEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    path = tmp_path / name / "s.sqlite3"
    for i, batch in enumerate(batches):
        store = StateStore(path, SCHEMA)  # reopened per batch: a restart rebuilds the cache
        stage = RewardStage(G, Topics("t."), store, CollectorRegistry())
        if i == fail_at:
            with pytest.raises(RuntimeError), store.txn():
                stage.process(batch, 10.0)
                raise RuntimeError("crash before commit")
        with store.txn():
            stage.process(batch, 10.0)
        store.close()
    store = StateStore(path, SCHEMA)
    rows = [decode(RewardEvent, r.value) for r in store.pending([0], limit=10**6)]
    store.close()
    return [(r.generation_id, r.weight, r.flags) for r in rows]


def test_stage_guard_counts_survive_rollback_and_restart(tmp_path):
    recs = _records(120)
    once = _rewards(tmp_path, "once", [recs])
    split = _rewards(tmp_path, "split", [recs[:40], recs[40:41] + recs[:10], recs[41:]], fail_at=1)
    assert len(once) == 120 and split == once  # duplicates folded, rollback forgot its counts
    assert any("user_cap" in f for _, _, f in once)  # the guard actually fired in this stream


@pytest.mark.parametrize(("ep", "reward", "components", "weight", "flags"), [
    (episode(), 0.75, {"signal": 0.75}, 1.0, ()),
    (episode("edit", text='é "q"\n\u2028<tab>\t', edited="x", ms=12.5, tokens=(5, 6, 7, 8)), 0.3125,
     {"signal": 0.5, "edit": -0.1875, "length_penalty": -0.0}, 0.2, ("long", "constant_user")),
    (episode("reject", text=""), -1.25, {"signal": -0.25, "verifier_nonempty": -1.0}, 0.0, ("user_cap",)),
    (episode("ignore", tokens=()), 0.0, {}, 1.0, ()),
    (episode().model_copy(update={"rater_id": "r"}), 0.75, {"signal": 0.75}, 1.0, ()),
    (episode().model_copy(update={"generation": episode().generation.model_copy(update={"sampling": SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, max_tokens=8, seed=7, stop=("\n", "END"), logprobs_mode="raw")})}),
     1.0, {"signal": 1.0}, 1.0, ()),
    # vLLM's extras: written only when they ask for something (flywheel/contracts.py's _extra)
    (episode().model_copy(update={"generation": episode().generation.model_copy(update={"sampling": SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=8, min_p=0.05, min_tokens=2, stop_token_ids=(3, 9), ignore_eos=True,
        skip_special_tokens=False)})}), 1.0, {"signal": 1.0}, 1.0, ()),
])
def test_reward_bytes_are_the_encoded_reward_event(ep, reward, components, weight, flags):
    from flywheel.contracts import RewardEvent, decode, encode
    from reward.stage import reward_bytes

    g = ep.generation
    built = RewardEvent(
        generation_id=g.generation_id, group_id=g.group_id, user_id=g.user_id, rater_id=ep.rater_id,
        model_version=g.model_version, signal=ep.signal, prompt_token_ids=g.prompt_token_ids,
        completion_token_ids=g.completion_token_ids, logprobs=g.logprobs, sampling=g.sampling,
        reward=reward, components=components, weight=weight, flags=flags,
        generated_at=g.created_at, labeled_at=1700000010.987654)
    written = reward_bytes(ep, reward, components, weight, flags, 1700000010.987654)
    assert decode(RewardEvent, written) == built
    assert written == encode(built)


def test_stage_dead_letters_an_episode_its_labeler_fails_on_and_labels_its_replay(tmp_path):
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import DeadLetterEvent, RewardEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    broken = {"g3"}
    name = f"v{uuid.uuid4().hex[:6]}"
    register_verifier(name, lambda ep: 1 / 0 if ep.generation_id in broken else None)
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    registry = CollectorRegistry()
    stage = RewardStage(G.model_copy(update={"labelers": ("signal", f"verifier:{name}")}), Topics("t."), store, registry)
    # exported at 0 before the first failure, so an alert's increase() sees the first one
    assert registry.get_sample_value("reward_deadletters_total", {"reason": "labeler_error"}) == 0.0
    recs = _records(6)
    with store.txn():
        stage.process(recs, 10.0)  # the loop goes on past the failing episode
    out = store.pending([0], limit=100)
    assert [decode(RewardEvent, r.value).generation_id for r in out if r.topic == "t.rewards"] == ["g0", "g1", "g2", "g4", "g5"]
    (dead,) = [decode(DeadLetterEvent, r.value) for r in out if r.topic == "t.deadletter"]
    assert (dead.reason, dead.source_offset) == ("labeler_error", 3)
    assert dead.detail == f"labeler 'verifier:{name}': ZeroDivisionError: division by zero"
    assert registry.get_sample_value("reward_deadletters_total", {"reason": "labeler_error"}) == 1.0
    # the reward histogram by signal (the dashboard's "Reward p50 by signal"): g0 reject, g1-g5 accept
    assert [registry.get_sample_value("reward_value_reward_count", {"signal": s}) for s in ("accept", "reject")] == [4, 1]

    broken.clear()  # fixed; the dead letter is replayed, along with an already-labeled episode
    with store.txn():
        stage.process([recs[3], recs[0]], 11.0)
    rewards = [decode(RewardEvent, r.value) for r in store.pending([0], limit=100) if r.topic == "t.rewards"]
    assert [r.generation_id for r in rewards] == ["g0", "g1", "g2", "g4", "g5", "g3"]
    assert registry.get_sample_value("reward_duplicates_total") == 1.0


def test_labeled_ids_are_remembered_for_dedupe_retention_s(tmp_path):
    """Inside ``reward.dedupe_retention_s`` a repeated episode is dropped; past it the id is
    forgotten (the limit the dead-letter runbook gives for repeating a replay)."""
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import Topics
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    registry = CollectorRegistry()
    stage = RewardStage(G.model_copy(update={"dedupe_retention_s": 100.0}), Topics("t."), store, registry)
    (rec,) = _records(1)
    for now in (1000.0, 1099.0, 1161.0, 1170.0):  # ids are pruned on tick, at most once a minute
        with store.txn():
            stage.process([rec], now)
            stage.tick({0}, now)
    # dropped at 1099 and 1161 (the tick after it forgets the id), labeled again at 1170
    assert registry.get_sample_value("reward_duplicates_total") == 2.0
    assert sum(r.topic == "t.rewards" for r in store.pending([0], limit=100)) == 2
    store.close()


def test_a_labeler_message_that_cannot_be_encoded_still_makes_a_dead_letter(tmp_path):
    """A labeler's message may quote text no UTF-8 encoder takes; the dead letter escapes it
    instead of failing the batch."""
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import DeadLetterEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    name = f"v{uuid.uuid4().hex[:6]}"

    def verifier(ep):
        raise ValueError("cannot score \ud800 here")

    register_verifier(name, verifier)
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = RewardStage(G.model_copy(update={"labelers": (f"verifier:{name}",)}), Topics("t."), store, CollectorRegistry())
    with store.txn():
        stage.process(_records(1), 10.0)
    (dead,) = [decode(DeadLetterEvent, r.value) for r in store.pending([0]) if r.topic == "t.deadletter"]
    assert dead.reason == "labeler_error" and dead.detail.endswith("ValueError: cannot score \\ud800 here")



def test_guard_penalties_that_make_the_reward_infinite_fail_the_episode(tmp_path):
    """The labelers' sum is checked finite, but the guards' penalties are added after it: past
    float's range the reward went on the wire as null, and the rewards archive refused its queue
    at every write, for good. Settings refuse such penalties now (below); a config that skipped
    their validation (``model_copy``) still fails its one episode, as a labeler error."""
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import DeadLetterEvent, RewardEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.report import reward_table
    from reward.stage import SCHEMA, RewardStage

    huge = G.model_copy(update={"length_penalty": 1e308, "length_penalty_max": 1e308,
                                "repetition_penalty": 1e308, "length_target_tokens": 16})
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    registry = CollectorRegistry()
    stage = RewardStage(huge, Topics("t."), store, registry)
    with store.txn():  # a long, degenerate completion (both penalties), then a short one
        stage.process([_record(_by("u", 0, tokens=(5,) * 40), 0), _record(_by("u", 1), 1)], 10.0)
    out = store.pending([0], limit=100)
    rewards = [r.value for r in out if r.topic == "t.rewards"]
    assert [decode(RewardEvent, v).generation_id for v in rewards] == ["g1"]
    assert reward_table(rewards)[1].column("reward").to_pylist() == [0.75]  # the archive takes it
    (dead,) = [decode(DeadLetterEvent, r.value) for r in out if r.topic == "t.deadletter"]
    assert (dead.reason, dead.source_offset) == ("labeler_error", 0)
    assert dead.detail == ("labeler 'signal + edit + latency + length_penalty + repetition_penalty': "
                           "components add up to -inf, not a finite reward")
    # failed before the guards counted it: no flag raised, one sample of its user, not two
    assert registry.get_sample_value("reward_guard_actions_total", {"flag": "long"}) == 0.0
    assert store.db.execute("SELECT n, kept FROM user_win WHERE user='u'").fetchall() == [(1, 1)]
    store.close()


@pytest.mark.parametrize("field", ["length_penalty_max", "repetition_penalty"])
def test_guard_penalties_are_bounded(field):
    from pydantic import ValidationError

    assert getattr(RewardSettings(**{field: 1e6}), field) == 1e6
    with pytest.raises(ValidationError, match=f"{field}\n  Input should be less than or equal to 1000000"):
        RewardSettings(**{field: 1e308})


def test_a_bad_episode_is_dead_lettered_by_its_own_shard(tmp_path):
    """The dead letter for an undecodable episode belongs to the partition it came from: a process
    serving other shards would never deliver it, nor recover it after a crash."""
    from kafka.consumer.fetcher import ConsumerRecord
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import DeadLetterEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = RewardStage(G, Topics("t."), store, CollectorRegistry())
    bad = ConsumerRecord(topic="t.episodes", partition=2, leader_epoch=-1, offset=7, timestamp=0, timestamp_type=0,
                         key=b"g", value=b"{not json", headers=[], checksum=None, serialized_key_size=1,
                         serialized_value_size=9, serialized_header_size=0)
    with store.txn():  # first in the batch and in the process's life: no earlier record set a shard
        stage.process([bad, *_records(1)], 10.0)
    assert store.pending([0, 1, 3]) and not any(r.topic == "t.deadletter" for r in store.pending([0, 1, 3]))
    (row,) = store.pending([2])
    dead = decode(DeadLetterEvent, row.value)
    assert (row.topic, dead.reason, dead.source_partition, dead.source_offset) == ("t.deadletter", "undecodable", 2, 7)
    store.close()


def test_every_guard_action_is_counted_by_flag(tmp_path):
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import RewardEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    registry = CollectorRegistry()
    stage = RewardStage(G, Topics("t."), store, registry)
    # every series exists from the start, so that rate() sees the first burst of any of them
    assert registry.get_sample_value("reward_skipped_total", {"reason": "no_signal"}) == 0
    gaming = [episode(tokens=tuple(range(300))), episode(tokens=(5,) * 20), episode(tokens=(7,) * 400)]
    with store.txn():
        stage.process(_records(120) + [_record(EpisodeEvent(
            generation=ep.generation.model_copy(update={"generation_id": f"x{i}", "user_id": f"x{i}"}),
            signal="accept", resolved_at=2), 120 + i) for i, ep in enumerate(gaming)], 10.0)
    flags = [f for r in store.pending([0], limit=1000) for f in decode(RewardEvent, r.value).flags]
    assert {"user_cap", "rate_anomaly"} <= set(flags)  # the flooding user (every other episode)
    assert flags.count("long") == 2 and flags.count("repetition") == 2  # the gaming completions
    for flag in ("user_cap", "constant_user", "rate_anomaly", "long", "repetition"):  # unraised: at 0
        assert registry.get_sample_value("reward_guard_actions_total", {"flag": flag}) == flags.count(flag)
    assert registry.get_sample_value("reward_flagged_samples_total", {"kind": "hacking"}) == 3
    assert registry.get_sample_value("reward_rewards_total", {"signal": "accept"}) + registry.get_sample_value(
        "reward_rewards_total", {"signal": "reject"}) == 123
    store.close()


# -- guard counts are kept by event time: a backlog is judged as it was live -----------------
HOUR = 3600.0
LIVE = 1_800_000_000.0  # the wall clock in these tests: a window boundary (3600 divides it)


def _episodes_at(n: int, created_at: float, shard: int = 0, start: int = 0) -> list:
    """``n`` episodes generated at ``created_at`` on ``shard``, every other one the flooder's."""
    out = []
    for i in range(start, start + n):
        g = episode().generation.model_copy(update={
            "generation_id": f"g{shard}-{i}", "user_id": "flood" if i % 2 else f"u{i % 5}",
            "created_at": created_at, "completed_at": created_at})
        ep = EpisodeEvent(generation=g, signal=("accept", "reject")[i % 3 == 0], resolved_at=created_at)
        out.append(_record(ep, i, shard))
    return out


def _reward_stage(tmp_path, name: str):
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import Topics
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    store = StateStore(tmp_path / name / "s.sqlite3", SCHEMA)
    return store, RewardStage(G, Topics("t."), store, CollectorRegistry())


def _flags(store, shards=(0, 1)) -> dict[str, tuple[str, ...]]:
    from flywheel.contracts import RewardEvent, decode

    rows = [decode(RewardEvent, r.value) for r in store.pending(list(shards), limit=10**6) if r.topic == "t.rewards"]
    return {r.generation_id: r.flags for r in rows}


def _backlog_judged_live(tmp_path) -> tuple[list, dict[str, tuple[str, ...]]]:
    """200 episodes of six hours ago, and their flags when labeled as they came in, at once."""
    old = LIVE - 6 * HOUR
    recs = _episodes_at(200, old)
    store, stage = _reward_stage(tmp_path, "live")
    with store.txn():
        stage.process(recs, old + 60)
    return recs, _flags(store)


def _windows(store) -> list[int]:
    return sorted({w for (w,) in store.db.execute("SELECT win FROM user_win")})


def test_a_backlog_is_judged_with_the_counts_it_would_have_had_live(tmp_path):
    """Six hours of backlog, read in batches a minute or more apart with a prune on each: the
    flooder's counts carry over from batch to batch, as they did when all came at once. Pruned by
    the wall clock, the counts of a window hours old restarted at every prune."""
    recs, at_once = _backlog_judged_live(tmp_path)
    store, stage = _reward_stage(tmp_path, "backlog")
    for i in range(0, 200, 20):
        now = LIVE + 61 * i
        with store.txn():
            stage.process(recs[i:i + 20], now)
            stage.tick({0}, now)
    assert _flags(store) == at_once
    assert sum("user_cap" in f for f in at_once.values()) >= 50  # the cap fired all along


def test_guard_counts_of_a_window_are_pruned_once_every_shard_is_past_it_by_more_than_two(tmp_path):
    store, stage = _reward_stage(tmp_path, "s")

    def step(recs, now):
        with store.txn():
            stage.process(recs, now)
            stage.tick({0, 1}, now)

    def windows():
        return _windows(store)

    w = int(LIVE // HOUR)
    step(_episodes_at(4, LIVE - 5 * HOUR, shard=1) + _episodes_at(4, LIVE - 5 * HOUR, shard=0), LIVE)
    step(_episodes_at(4, LIVE, shard=0, start=10), LIVE + 100)  # shard 0 is live, shard 1 still behind
    assert windows() == [w - 5, w]
    step(_episodes_at(4, LIVE - 3 * HOUR + 1, shard=1, start=10), LIVE + 200)  # shard 1 moves on
    assert windows() == [w - 5, w - 3, w]  # w-5 is only two windows behind shard 1
    step(_episodes_at(4, LIVE - 2 * HOUR + 1, shard=1, start=20), LIVE + 300)
    assert windows() == [w - 3, w - 2, w]  # now it is three behind both shards
    # a clock far in the future moves its shard only as far as now: the windows before stay
    step(_episodes_at(4, LIVE + 50 * HOUR, shard=1, start=30), LIVE + 400)
    assert windows() == [w - 2, w, w + 50]
    step(_episodes_at(2, LIVE - 1 * HOUR, shard=0, start=40), LIVE + 500)  # a late one, still counted
    assert windows() == [w - 2, w - 1, w, w + 50]
    # a shard that sends nothing for a guard window stops holding counts back; with no shard in
    # flight nothing is pruned, not even by the wall clock
    step([], LIVE + 10 * HOUR)
    assert windows() == [w - 2, w - 1, w, w + 50]
    step(_episodes_at(2, LIVE + 10 * HOUR, shard=0, start=50), LIVE + 10 * HOUR + 100)
    assert windows() == [w + 10, w + 50]
    store.close()


def test_a_restart_mid_backlog_keeps_the_counts_of_the_windows_it_was_filling(tmp_path):
    """Restarted and idle (no episode yet), the stage has no shard in flight: its first prune
    must not judge the backlog's windows by the wall clock."""
    recs, at_once = _backlog_judged_live(tmp_path)
    store, stage = _reward_stage(tmp_path, "restarted")
    with store.txn():
        stage.process(recs[:100], LIVE)
    store.close()
    store, stage = _reward_stage(tmp_path, "restarted")
    with store.txn():
        stage.tick({0}, LIVE + 120)  # the first turn after the restart polled nothing
    with store.txn():
        stage.process(recs[100:], LIVE + 180)
    assert _flags(store) == at_once


def test_the_guards_judge_the_user_who_sent_the_signal(tmp_path):
    """One account accepting 60 generations of 60 other users is capped and flagged as constant:
    counted by the generations' users, each of them had sent one signal."""
    from flywheel.contracts import RewardEvent, decode

    recs = []
    for i in range(120):
        g = episode().generation.model_copy(update={"generation_id": f"g{i}", "user_id": f"owner{i}"})
        rater = "rater" if i % 2 else f"owner{i}"  # every other signal is the one account's
        recs.append(_record(EpisodeEvent(generation=g, signal="accept", feedback_ids=(f"f{i}",), rater_id=rater,
                                         resolved_at=2), i))
    store, stage = _reward_stage(tmp_path, "s")
    with store.txn():
        stage.process(recs, 10.0)
    rewards = [decode(RewardEvent, r.value) for r in store.pending([0], limit=1000) if r.topic == "t.rewards"]
    mine = [r for r in rewards if r.rater_id == "rater"]
    assert len(mine) == 60 and all(r.user_id != "rater" for r in mine)
    assert all("constant_user" in r.flags for r in mine[G.constant_min_signals - 1:])
    assert sum("user_cap" in r.flags for r in mine) >= 30 and sum(r.weight > 0 for r in mine) <= 0.2 * sum(
        r.weight > 0 for r in rewards)
    others = [r for r in rewards if r.rater_id != "rater"]
    assert not any({"user_cap", "constant_user"} & set(r.flags) for r in others)


def test_a_restart_remembers_a_shard_that_is_behind(tmp_path):
    """Shard 1 is hours behind when the stage restarts, and its first turn reads only shard 0:
    the counts shard 1 is still filling stay, until it has sent nothing for a guard window."""
    w = int(LIVE // HOUR)
    store, stage = _reward_stage(tmp_path, "s")
    with store.txn():
        stage.process(_episodes_at(4, LIVE - 5 * HOUR, shard=1) + _episodes_at(4, LIVE, shard=0), LIVE)
    store.close()
    store, stage = _reward_stage(tmp_path, "s")
    for i, now in enumerate((LIVE + 120, LIVE + 200, LIVE + 120 + HOUR)):  # restarted, then running
        with store.txn():
            stage.process(_episodes_at(2, LIVE + 1, shard=0, start=10 * i), now)
            stage.tick({0, 1}, now)
        if i == 1:
            assert _windows(store) == [w - 5, w]
    assert _windows(store) == [w]  # (shard 1 was loaded at LIVE+120 and sent nothing since)
    assert store.db.execute("SELECT shard, win FROM reached").fetchall() == [(0, w)]


def test_a_rolled_back_batch_does_not_move_its_shard_on(tmp_path):
    """How far a shard has got is state like the counts: a batch that rolls back (to be read
    again) must not leave its shard moved on, or the next prune forgets counts still in use."""
    w = int(LIVE // HOUR)
    store, stage = _reward_stage(tmp_path, "s")
    with store.txn():
        stage.process(_episodes_at(4, LIVE - 5 * HOUR), LIVE)
    with pytest.raises(RuntimeError), store.txn():
        stage.process(_episodes_at(4, LIVE, start=10), LIVE + 10)
        raise RuntimeError("the turn failed before its commit")
    with store.txn():
        stage.tick({0}, LIVE + 20)
    assert _windows(store) == [w - 5]


def _stage_rewards(tmp_path, cfg: RewardSettings, episodes: list[EpisodeEvent]):
    """The rewards one reward stage emits for ``episodes`` in one batch, and its registry."""
    from prometheus_client import CollectorRegistry

    from flywheel.contracts import RewardEvent, Topics, decode
    from flywheel.stream.store import StateStore
    from reward.stage import SCHEMA, RewardStage

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    registry = CollectorRegistry()
    stage = RewardStage(cfg, Topics("t."), store, registry)
    with store.txn():
        stage.process([_record(ep, i) for i, ep in enumerate(episodes)], 10.0)
    rewards = [decode(RewardEvent, r.value) for r in store.pending([0], limit=10**6) if r.topic == "t.rewards"]
    store.close()
    return rewards, registry


def _by(user: str, i: int, signal: str = "accept", tokens=(1, 2, 3), **episode_fields) -> EpisodeEvent:
    ep = episode(signal, tokens=tokens)
    g = ep.generation.model_copy(update={"generation_id": f"g{i}", "user_id": user})
    return ep.model_copy(update={"generation": g, **episode_fields})


def test_timed_out_episodes_count_toward_the_cap_and_are_nobodys_signal(tmp_path):
    """With ``emit_ignored``, a user whose generations time out sent no signal: the guards must
    not flag them constant or anomalous for it, nor judge their one real signal by those
    timeouts; but the samples go to training, so they count toward the user's share cap."""
    timeouts = [_by("alice", i, "ignore", timed_out=True) for i in range(60)]
    others = [_by(f"u{i}", 100 + i, ("accept", "reject")[i % 2], rater_id=f"u{i}") for i in range(40)]
    real = _by("alice", 60, "reject", rater_id="alice")
    rewards, registry = _stage_rewards(tmp_path, G.model_copy(update={"emit_ignored": True}),
                                       [*timeouts, *others, real])
    flags = {f for r in rewards for f in r.flags}
    assert len(rewards) == 101 and flags == {"user_cap"}  # no constant_user, no rate_anomaly
    kept = [r for r in rewards if r.weight > 0]
    alice = [r for r in kept if r.user_id == "alice"]
    # user_cap_min (5) of her 60 timeouts, while the window had few kept samples; then her real
    # signal, within a fifth of the 46 kept by then, judged by no flag her timeouts raised
    assert [r.generation_id for r in alice] == ["g0", "g1", "g2", "g3", "g4", "g60"]
    assert rewards[-1].flags == () and rewards[-1].reward == -0.25
    assert registry.get_sample_value("reward_guard_actions_total", {"flag": "constant_user"}) == 0


def test_a_flood_of_unrated_generations_gets_no_more_than_its_share(tmp_path):
    """Nine in ten samples are one user's generations that time out: with ``emit_ignored`` they
    go to training, and that user's share of what does stays within ``user_cap_share``."""
    eps = [_by("flood", i, "ignore", timed_out=True) if i % 10 else
           _by(f"u{i}", i, "accept", rater_id=f"u{i}") for i in range(1000)]
    rewards, _ = _stage_rewards(tmp_path, G.model_copy(update={"emit_ignored": True}), eps)
    kept = [r for r in rewards if r.weight > 0]
    assert sum(r.user_id == "flood" for r in kept) <= 0.2 * len(kept) + 1


def test_flagged_samples_are_counted_once_each_by_kind(tmp_path):
    """The alerts' share of flagged samples: a sample with three abuse flags is one abuse sample."""
    floods = [_by("flood", i) for i in range(40)]  # past the cap, constant and anomalous at once
    others = [_by(f"u{i}", 100 + i, "reject", tokens=tuple(range(300)) if i < 3 else (1, 2, 3)) for i in range(10)]
    rewards, registry = _stage_rewards(tmp_path, G, [*floods, *others])
    abuse = sum(any(f in ("user_cap", "constant_user", "rate_anomaly") for f in r.flags) for r in rewards)
    actions = sum(registry.get_sample_value("reward_guard_actions_total", {"flag": f})
                  for f in ("user_cap", "constant_user", "rate_anomaly"))
    assert 0 < abuse < actions  # samples carried several abuse flags
    assert registry.get_sample_value("reward_flagged_samples_total", {"kind": "abuse"}) == abuse
    assert registry.get_sample_value("reward_flagged_samples_total", {"kind": "hacking"}) == 3  # the long ones


class _OddKeys(dict):
    """A mapping whose keys are not hashable strings: what a labeler with a bug might return."""

    def items(self):
        return [([1, 2], 0.5)]


def test_a_mapping_with_an_unhashable_key_fails_its_episode_not_the_stage():
    register_labeler("odd_keys")(lambda cfg: lambda ep: _OddKeys())
    with pytest.raises(LabelerError, match="is not a str"):
        build_labeler(RewardSettings(labelers=("odd_keys",)))(episode())


def test_names_checked_once_are_still_checked_for_a_second_labeler_giving_them():
    register_labeler("gives_signal")(lambda cfg: lambda ep: {"signal": 0.1})
    label = build_labeler(RewardSettings(labelers=("signal", "gives_signal")))
    for _ in range(3):  # the name passes the name checks once; the repeat is refused every time
        with pytest.raises(LabelerError, match="was given by labeler 'signal' already"):
            label(episode())
