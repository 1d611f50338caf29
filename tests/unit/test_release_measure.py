"""The canary's measurement (release/measure.py): which records count, who counts, how outcomes are
paired, and that a saved tally resumes exactly where it stopped.

Every record is built through flywheel/contracts.py and read back as the controller reads it
(``decode`` of the encoded bytes: release/streams.py), so a renamed field fails here instead of
zeroing a count.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from flywheel.contracts import (
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from release import measure
from release.measure import Tally
from release.sequential import PairCount

T0 = 1_000.0
SAMPLING = SamplingParams(temperature=1, top_p=1, max_tokens=4)


def episode(gid: str, version: int, t: float, signal: str, user: str = "", latency: float = 10.0,
            finish: str = "stop", tokens: int = 4, route: str = "stable", rater: str | None = None,
            text: str = "c") -> EpisodeEvent:
    gen = GenerationEvent(generation_id=gid, group_id=gid, model_name="m", model_version=version,
                          user_id=user or gid, endpoint="chat", created_at=t, completed_at=t, latency_ms=latency,
                          prompt_text="p", prompt_token_ids=(1,), completion_text=text,
                          completion_token_ids=(1,) * tokens, logprobs=(-0.5,) * tokens, sampling=SAMPLING,
                          finish_reason=finish, route=route)
    ep = EpisodeEvent(generation=gen, signal=signal, timed_out=signal == "ignore",
                      feedback_ids=() if signal == "ignore" else (f"f-{gid}",), rater_id=rater,
                      edited_text="e" if signal == "edit" else None, resolved_at=t + 1)
    return decode(EpisodeEvent, encode(ep))


def reward(gid: str, version: int, t: float, user: str = "", flags: tuple[str, ...] = (),
           signal: str = "accept", rater: str | None = None) -> RewardEvent:
    rw = RewardEvent(generation_id=gid, group_id=gid, user_id=user or gid, rater_id=rater, model_version=version,
                     signal=signal, prompt_token_ids=(1,), completion_token_ids=(1,), logprobs=(-0.5,),
                     sampling=SAMPLING, reward=1.0, flags=flags, generated_at=t, labeled_at=t + 2)
    return decode(RewardEvent, encode(rw))


def judged(t: Tally, gid: str, version: int, at: float, signal: str, user: str = "", flags=()) -> None:
    """One user's signal and reward's judgement of it, in the order they usually arrive."""
    t.add_episode(episode(gid, version, at, signal, user=user))
    t.add_reward(reward(gid, version, at, user=user, flags=flags, signal=signal))


def tally(**kw) -> Tally:
    return Tally(stable_version=0, canary_version=7, started_at=T0, **kw)


def outcomes(t: Tally) -> dict[str, tuple[int, int, int]]:
    """(outcomes, accepts, rejects) per arm."""
    return {name: (arm.outcomes, arm.accepts, arm.rejects) for name, arm in t.arms.items()}


# -- which records count ---------------------------------------------------------------------

def test_only_the_two_versions_after_the_start_count_and_only_explicit_signals_are_outcomes():
    t = tally()
    judged(t, "old", 7, T0 - 1, "accept")  # before the canary started
    judged(t, "other", 3, T0 + 1, "accept")  # neither arm
    t.add_episode(episode("ig", 7, T0 + 2, "ignore"))
    judged(t, "ab", 7, T0 + 3, "reject")
    t.add_episode(episode("ab2", 7, T0 + 3, "ignore", finish="abort"))
    judged(t, "ok", 0, T0 + 4, "edit")
    canary, stable = t.arms["canary"].stats(), t.arms["stable"].stats()
    assert (canary.requests, canary.outcomes, canary.errors, canary.rejects) == (3, 1, 1, 1)
    assert (stable.requests, stable.outcomes, stable.accepts, stable.rejects) == (1, 1, 0, 0)


def test_pinned_evaluation_traffic_is_in_neither_arm():
    t = tally()
    t.add_episode(episode("eval", 7, T0 + 1, "accept", route="pinned"))  # a request that named flywheel@v7
    t.add_episode(episode("user", 7, T0 + 2, "accept"))
    assert t.arms["canary"].stats().requests == 1


def test_a_repeated_record_counts_once():
    t = tally()
    for _ in range(3):  # the episodes and rewards topics are at least once
        t.add_episode(episode("g1", 7, T0 + 1, "accept"))
        t.add_reward(reward("g1", 7, T0 + 1, flags=("repetition",)))
    arm = t.arms["canary"]
    assert (arm.requests, arm.outcomes, arm.rewards, arm.flagged) == (1, 1, 1, 1)


def test_only_flags_about_the_answer_count_against_a_version():
    # an abusive user is excluded (below), never read as a worse model
    t = tally()
    flags = [("constant_user",), ("user_cap", "rate_anomaly"), ("long",), ("repetition", "constant_user"), ()]
    for i, f in enumerate(flags):
        t.add_reward(reward(f"g{i}", 7, T0 + 1, user=f"u{i}", flags=f))
    assert (t.arms["canary"].rewards, t.arms["canary"].flagged) == (5, 2)


def test_rewards_of_generations_from_before_the_start_are_no_guardrail_count_but_flag_their_user():
    t = tally()
    t.add_reward(reward("g", 0, T0 - 5, user="abuser", flags=("constant_user", "long")))
    assert t.arms["stable"].rewards == 0 and t.arms["stable"].flagged == 0
    judged(t, "g2", 7, T0 + 1, "accept", user="abuser")  # what reward said of them still holds
    assert t.arms["canary"].outcomes == 0 and t.measurement(T0 + 2).excluded_users == 1


# -- who counts --------------------------------------------------------------------------------
# (records in arrival order) -> (outcomes counted, accepts, rejects) per arm, outcomes dropped
# per arm, users excluded, users flagged after their outcome counted
E, R = "episode", "reward"
WHO = {
    "a judged signal counts": (
        [(E, "g1", 7, "accept", "ann", ()), (R, "g1", 7, "accept", "ann", ())],
        {"canary": (1, 1, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0),
    "a signal reward has not judged yet waits (pending), not an outcome yet": (
        [(E, "g1", 0, "reject", "ann", ())],
        {"canary": (0, 0, 0), "stable": (0, 0, 1)}, {"canary": 0, "stable": 0}, 0, 0),
    "a reward that arrives before its episode settles it when the episode comes": (
        [(R, "g1", 0, "accept", "ann", ()), (E, "g1", 0, "accept", "ann", ())],
        {"canary": (0, 0, 0), "stable": (1, 1, 0)}, {"canary": 0, "stable": 0}, 0, 0),
    "its own reward flags the user: dropped, and the user excluded": (
        [(E, "g1", 7, "accept", "abuser", ()), (R, "g1", 7, "accept", "abuser", ("constant_user",))],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 1, "stable": 0}, 1, 0),
    "flagged on another generation while the outcome waits: dropped": (
        [(E, "g1", 7, "accept", "abuser", ()), (R, "g0", 3, "accept", "abuser", ("rate_anomaly",)),
         (R, "g1", 7, "accept", "abuser", ())],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 1, "stable": 0}, 1, 0),
    "a flagged user's later signals are neither outcomes nor rejects": (
        [(R, "g0", 3, "accept", "abuser", ("user_cap",)), (E, "g1", 0, "reject", "abuser", ()),
         (R, "g1", 0, "reject", "abuser", ())],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 1, 0),
    "flagged after their outcome counted: it stays (pairs are fixed), and is shown": (
        [(E, "g1", 0, "accept", "late", ()), (R, "g1", 0, "accept", "late", ()),
         (R, "g2", 0, "accept", "late", ("constant_user",))],
        {"canary": (0, 0, 0), "stable": (1, 1, 0)}, {"canary": 0, "stable": 0}, 1, 1),
    "one outcome per user per canary: their first signal to arrive": (
        [(E, "g1", 7, "reject", "ann", ()), (E, "g2", 7, "accept", "ann", ()), (R, "g2", 7, "accept", "ann", ()),
         (R, "g1", 7, "reject", "ann", ())],
        {"canary": (1, 0, 1), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0),
    "a flag about the answer is no flag about the user": (
        [(E, "g1", 7, "accept", "ann", ()), (R, "g1", 7, "accept", "ann", ("long", "repetition"))],
        {"canary": (1, 1, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0),
}


@pytest.mark.parametrize("name", list(WHO))
def test_who_counts(name):
    records, counted, dropped, excluded, flagged_late = WHO[name]
    t = tally()
    for i, (kind, gid, version, signal, user, flags) in enumerate(records):
        if kind == E:
            t.add_episode(episode(gid, version, T0 + 1 + i, signal, user=user))
        else:
            t.add_reward(reward(gid, version, T0 + 1 + i, user=user, flags=flags, signal=signal))
    m = t.measurement(T0 + 60)
    assert outcomes(t) == counted
    assert {name: arm.excluded for name, arm in t.arms.items()} == dropped
    assert (m.excluded_users, m.flagged_after_counting) == (excluded, flagged_late)
    assert m.canary.excluded == dropped["canary"] and m.stable.excluded == dropped["stable"]


def test_the_rater_is_the_user_who_counts():
    # one account rating other users' generations is one user: its rater id, as reward judges it
    t = tally()
    for i in range(3):
        t.add_episode(episode(f"g{i}", 7, T0 + i, "accept", user=f"owner{i}", rater="rater"))
        t.add_reward(reward(f"g{i}", 7, T0 + i, user=f"owner{i}", rater="rater"))
    assert outcomes(t)["canary"] == (1, 1, 0)


def test_outcomes_waiting_for_reward_are_shown_and_bounded(monkeypatch):
    monkeypatch.setattr(measure, "MAX_PENDING", 3)
    t = tally()
    for i in range(5):
        t.add_episode(episode(f"g{i}", 0, T0 + i, "accept", user=f"u{i}"))
    assert t.measurement(T0 + 9).stable.pending == 3  # the two oldest were given up on
    t.add_episode(episode("g9", 0, T0 + 9, "reject", user="u0"))  # so u0 may count with another signal
    t.add_reward(reward("g9", 0, T0 + 9, user="u0", signal="reject"))
    t.add_reward(reward("g0", 0, T0, user="u0"))  # its first one, too late: nothing waits for it
    assert outcomes(t)["stable"] == (1, 0, 1)


# -- pairing -----------------------------------------------------------------------------------

def test_pairs_are_formed_as_outcomes_are_judged_and_never_change():
    t = tally()
    judged(t, "s1", 0, T0 + 1, "accept")
    judged(t, "s2", 0, T0 + 2, "reject")
    judged(t, "c1", 7, T0 + 3, "accept")  # meets s2, the most recent waiting stable: a canary win
    assert t.pairs() == PairCount(1, 1, 0)
    judged(t, "c2", 7, T0 + 4, "reject")  # meets s1: a loss
    assert t.pairs() == PairCount(2, 1, 1)


def test_late_feedback_pairs_when_it_is_judged_and_moves_no_formed_pair():
    """The rule: outcomes are taken in the order reward judges them, whenever their generation was
    made after the canary started; a generation from before the start never counts."""
    t = tally()
    judged(t, "s1", 0, T0 + 50, "reject")
    judged(t, "c1", 7, T0 + 51, "accept")
    before = t.pairs()
    judged(t, "c0", 7, T0 + 1, "reject")  # made long ago, its feedback late: it waits, pairs later
    assert t.pairs() == before == PairCount(1, 1, 0)
    judged(t, "s0", 0, T0 + 60, "accept")
    assert t.pairs() == PairCount(2, 1, 1)
    judged(t, "older", 0, T0 - 300, "accept", user="x")  # from before the canary: never counts
    judged(t, "c3", 7, T0 + 70, "accept", user="y")
    assert t.pairs() == PairCount(2, 1, 1) and t.arms["stable"].outcomes == 2


def test_pairing_never_looks_at_the_outcomes():
    # the same arrival order with the outcomes swapped pairs the same positions
    t = tally()
    for i, sig in enumerate(["reject", "accept", "reject", "accept"]):
        judged(t, f"s{i}", 0, T0 + 1, sig)
        judged(t, f"c{i}", 7, T0 + 1, "accept" if sig == "reject" else "reject")
    assert t.pairs() == PairCount(pairs=4, wins=2, losses=2)


def random_records(seed: int, n: int) -> list[tuple[str, EpisodeEvent | RewardEvent]]:
    """Episodes and rewards of 40 users in a shuffled arrival order, one abusive."""
    rnd = random.Random(seed)
    recs = []
    for i in range(n):
        user = f"u{rnd.randrange(40)}"
        version = rnd.choice([0, 0, 7])
        signal = rnd.choice(["accept", "reject", "ignore"])
        flags = ("constant_user",) if user == "u3" and rnd.random() < 0.7 else ()
        recs.append(("e", episode(f"g{i}", version, T0 + rnd.random() * 100, signal, user=user)))
        if signal != "ignore":
            recs.append(("r", reward(f"g{i}", version, T0 + 1, user=user, flags=flags, signal=signal)))
    rnd.shuffle(recs)
    return recs


def fold(t: Tally, rec: tuple[str, EpisodeEvent | RewardEvent]) -> None:
    (t.add_episode if rec[0] == "e" else t.add_reward)(rec[1])


def test_a_saved_tally_resumes_exactly_and_its_pairs_only_grow(monkeypatch):
    monkeypatch.setattr(measure, "DEDUPE_IDS", 50)
    recs = random_records(3, 300)
    whole, counts = tally(alpha=0.02), []
    for rec in recs:
        fold(whole, rec)
        counts.append(whole.pairs())
    assert all(b.pairs >= a.pairs and b.wins >= a.wins and b.losses >= a.losses
               for a, b in itertools.pairwise(counts))
    resumed = tally(alpha=0.02)
    for i, rec in enumerate(recs):
        if i % 37 == 0:  # saved with the candidate as JSON, then read back by a restarted controller
            resumed = Tally.from_dict(json.loads(json.dumps(resumed.to_dict())))
        fold(resumed, rec)
        assert resumed.pairs() == counts[i]
    assert resumed.to_dict() == whole.to_dict() and resumed.alpha == 0.02
    assert whole.measurement(T0 + 200).excluded_users == 1  # u3
    # the dedupe window is bounded, and the restored one remembers the same ids
    assert len(resumed.seen_episodes) == 50


def test_a_tally_saved_by_the_previous_fold_resumes_its_offsets_and_counts_afresh():
    old = {"stable_version": 0, "canary_version": 7, "started_at": T0, "outcomes_per_user": 10,
           "arms": {a: {"outcomes": [[T0 + 1, 1]], "rejects": 0, "requests": 3, "errors": 0, "latencies_ms": [5.0],
                        "tokens": 6, "flagged": 0, "rewards": 1, "per_user": {"u": 1}} for a in ("stable", "canary")},
           "seen_episodes": ["g1"], "seen_rewards": [], "offsets": {"episodes": {"0": 12}}, "errors": 0, "history": []}
    t = Tally.from_dict(old)
    # its pairs were rebuilt every tick, not folded: the accept-rate test starts again from here
    assert t.offsets == {"episodes": {0: 12}} and t.arms["canary"].requests == 3 and t.pairs() == PairCount()
    assert t.arms["canary"].outcomes == 0 and t.alpha is None


def test_latencies_are_a_bounded_sample(monkeypatch):
    monkeypatch.setattr(measure, "LATENCY_SAMPLE", 10)
    t = tally()
    for i in range(100):
        t.add_episode(episode(f"g{i}", 0, T0 + i, "ignore", latency=float(i)))
    assert t.arms["stable"].latencies_ms == [float(i) for i in range(90, 100)]


# -- the answers served, for the degeneracy guardrails ------------------------------------------

def test_the_answers_each_arm_served_are_profiled():
    t = tally()
    for i in range(3):
        t.add_episode(episode(f"c{i}", 7, T0 + i, "ignore", text="aaa eee ooo"))
        t.add_episode(episode(f"s{i}", 0, T0 + i, "accept", text="the cat sat on the mat"))
    t.add_episode(episode("c0", 7, T0 + 5, "ignore", text="aaa eee ooo"))  # a repeat
    t.add_episode(episode("early", 7, T0 - 1, "ignore", text="zzzzzzzz"))  # before the canary
    t.add_episode(episode("eval", 7, T0 + 1, "ignore", text="zzzzzzzz", route="pinned"))
    t.add_episode(episode("cut", 7, T0 + 1, "ignore", text="", finish="abort"))  # an error, judged as one
    canary, stable = t.measurement(T0 + 9).canary.text, t.measurement(T0 + 9).stable.text
    assert (canary.answers, stable.answers) == (3, 3)
    assert canary.repetition == pytest.approx(0.6) and stable.repetition == pytest.approx(6 / 21)


def test_a_degenerate_canary_is_rolled_back_on_what_it_served():
    from flywheel.settings import ReleaseSettings
    from release.judge import CanaryPolicy, Outcome, judge_canary

    t = tally()
    for i in range(60):
        t.add_episode(episode(f"c{i}", 7, T0 + i, "ignore", text=f"aaa{i} eee ooo"))
        t.add_episode(episode(f"s{i}", 0, T0 + i, "ignore", text=f"the answer number {i} is here"))
    v = judge_canary(t.measurement(T0 + 99), CanaryPolicy.of(ReleaseSettings(min_events=50)))
    assert v.outcome == Outcome.FAIL
    assert [r.split(" 0.")[0] for r in v.reasons] == ["guardrail character repetition",
                                                      "guardrail character-class stuffing: consonants"], v.reasons


def test_the_profiles_are_saved_with_the_tally():
    t = tally()
    t.add_episode(episode("c", 7, T0 + 1, "ignore", text="aaa eee"))
    back = Tally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.arms["canary"].text == t.arms["canary"].text and back.arms["canary"].text.answers == 1
    saved = t.to_dict()
    for arm in saved["arms"].values():
        del arm["text"]  # saved before the profiles were kept: they start from there
    assert Tally.from_dict(saved).arms["canary"].text.answers == 0
