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
from dataclasses import replace

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
from release.outcomes import Windows
from release.sequential import PairCount, Pairing

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

#: Past every window and reward's longest wait (release/outcomes.py JUDGE_WAIT_S): all read.
LATER = T0 + 1_000


def test_only_the_two_versions_after_the_start_count_and_every_user_answered_gives_one_outcome():
    t = tally()
    judged(t, "old", 7, T0 - 1, "accept")  # before the canary started
    judged(t, "other", 3, T0 + 1, "accept")  # neither arm
    t.add_episode(episode("ig", 7, T0 + 2, "ignore"))  # silent: an outcome, not accepted
    judged(t, "ab", 7, T0 + 3, "reject")
    t.add_episode(episode("ab2", 7, T0 + 3, "ignore", finish="abort"))  # an error: not accepted either
    judged(t, "ok", 0, T0 + 4, "edit")
    t.close(LATER)
    canary, stable = t.arms["canary"].stats(), t.arms["stable"].stats()
    assert (canary.requests, canary.outcomes, canary.accepts, canary.errors, canary.rejects) == (3, 3, 0, 1, 1)
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
        t.close(LATER)
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
    t.close(LATER)
    assert t.arms["canary"].outcomes == 0 and t.measurement(T0 + 2).excluded_users == 1


# -- who counts --------------------------------------------------------------------------------
# (records in arrival order: an episode or reward (kind, generation, version, signal, user, flags,
# answer time after T0), or C: the controller closing the windows due) -> (outcomes counted,
# accepts, rejects) per arm, outcomes dropped per arm, users excluded, users flagged after their
# outcome counted, users counted apart (release/measure.py left_apart)
E, R, C = "episode", "reward", ("close",)
NONE_APART = {"new_users": 0, "late_users": 0, "unjudged_users": 0, "switched_users": 0, "before_routing_users": 0}
WHO = {
    "a judged signal counts": (
        [(E, "g1", 7, "accept", "ann", (), 1), (R, "g1", 7, "accept", "ann", (), 1)],
        {"canary": (1, 1, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a user who said nothing is an outcome, not accepted": (
        [(E, "g1", 7, "ignore", "ann", (), 1)],
        {"canary": (1, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a signal reward never judges is given up, whatever it said": (
        [(E, "g1", 0, "accept", "ann", (), 1)],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0,
        NONE_APART | {"unjudged_users": 1}),
    "a reward that arrives before its episode judges it": (
        [(R, "g1", 0, "accept", "ann", (), 1), (E, "g1", 0, "accept", "ann", (), 1)],
        {"canary": (0, 0, 0), "stable": (1, 1, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "its own reward flags the user: dropped, and the user excluded": (
        [(E, "g1", 7, "accept", "abuser", (), 1), (R, "g1", 7, "accept", "abuser", ("constant_user",), 1)],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 1, "stable": 0}, 1, 0, NONE_APART),
    "flagged on another generation while the window is open: dropped": (
        [(E, "g1", 7, "accept", "abuser", (), 1), (R, "g0", 3, "accept", "abuser", ("rate_anomaly",), 1),
         (R, "g1", 7, "accept", "abuser", (), 1)],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 1, "stable": 0}, 1, 0, NONE_APART),
    "a flagged user's later signals are neither outcomes nor rejects": (
        [(R, "g0", 3, "accept", "abuser", ("user_cap",), 1), (E, "g1", 0, "reject", "abuser", (), 2),
         (R, "g1", 0, "reject", "abuser", (), 2)],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 1, 0, NONE_APART),
    "flagged after their outcome counted: it stays (pairs are fixed), and is shown": (
        [(E, "g1", 0, "accept", "late", (), 1), (R, "g1", 0, "accept", "late", (), 1), C,
         (R, "g2", 0, "accept", "late", ("constant_user",), 2)],
        {"canary": (0, 0, 0), "stable": (1, 1, 0)}, {"canary": 0, "stable": 0}, 1, 1, NONE_APART),
    "one outcome per user: the signal on their earliest answer, whichever arrived first": (
        [(E, "g2", 7, "accept", "ann", (), 1), (R, "g2", 7, "accept", "ann", (), 1),
         (E, "g1", 7, "reject", "ann", (), 1 - 1e-3), (R, "g1", 7, "reject", "ann", (), 1)],
        {"canary": (1, 0, 1), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a signal on an answer past the window is no outcome (window 0 s here)": (
        [(E, "g1", 7, "ignore", "ann", (), 1), (E, "g2", 7, "accept", "ann", (), 2), (R, "g2", 7, "accept", "ann", (), 2)],
        {"canary": (1, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a signal given after the window was read counts for nothing": (
        [(E, "g1", 7, "ignore", "ann", (), 1), C, (E, "g2", 7, "accept", "ann", (), 1),
         (R, "g2", 7, "accept", "ann", (), 1)],
        {"canary": (1, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a user whose first episode comes after later users were read is counted apart": (
        [(E, "g1", 0, "ignore", "bob", (), 5), C, (E, "g2", 7, "accept", "ann", (), 1),
         (R, "g2", 7, "accept", "ann", (), 1)],
        {"canary": (0, 0, 0), "stable": (1, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0,
        NONE_APART | {"late_users": 1}),
    "a flag about the answer is no flag about the user": (
        [(E, "g1", 7, "accept", "ann", (), 1), (R, "g1", 7, "accept", "ann", ("long", "repetition"), 1)],
        {"canary": (1, 1, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
    "a user answered by both arms in their window (0 s here: the same instant) is counted apart": (
        [(E, "g1", 0, "ignore", "ann", (), 1), (E, "g2", 7, "accept", "ann", (), 1),
         (R, "g2", 7, "accept", "ann", (), 1)],
        {"canary": (0, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0,
        NONE_APART | {"switched_users": 1}),
    "a stable user answered before the canary's first answer is counted apart": (
        [(E, "g1", 0, "accept", "early", (), 1), (R, "g1", 0, "accept", "early", (), 1),
         (E, "g2", 7, "accept", "ann", (), 2), (R, "g2", 7, "accept", "ann", (), 2)],
        {"canary": (1, 1, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0,
        NONE_APART | {"before_routing_users": 1}),
    "feedback on an answer by another user is no one's outcome": (
        [(E, "g1", 7, "accept", "owner", (), 1, "rater"), (R, "g1", 7, "accept", "owner", (), 1)],
        {"canary": (1, 0, 0), "stable": (0, 0, 0)}, {"canary": 0, "stable": 0}, 0, 0, NONE_APART),
}


@pytest.mark.parametrize("name", list(WHO))
def test_who_counts(name):
    records, counted, dropped, excluded, flagged_late, apart = WHO[name]
    t = tally()
    for rec in records:
        if rec == C:
            t.close(LATER)
            continue
        kind, gid, version, signal, user, flags, at, *rater = rec
        if kind == E:
            t.add_episode(episode(gid, version, T0 + at, signal, user=user, rater=rater[0] if rater else None))
        else:
            t.add_reward(reward(gid, version, T0 + at, user=user, flags=flags, signal=signal))
    t.close(LATER)
    m = t.measurement(LATER)
    assert outcomes(t) == counted
    assert {name: arm.excluded for name, arm in t.arms.items()} == dropped
    assert (m.excluded_users, m.flagged_after_counting) == (excluded, flagged_late)
    assert m.canary.excluded == dropped["canary"] and m.stable.excluded == dropped["stable"]
    assert t.left_apart() == apart


def test_users_new_after_the_start_are_counted_apart_unless_the_setting_counts_them():
    for count_new, counted in ((False, (1, 1, 0)), (True, (2, 2, 0))):
        t = tally(windows=Windows(count_new_users=count_new))
        t.add_episode(episode("before", 0, T0 - 30, "ignore", user="regular"))  # seen before the start
        judged(t, "g1", 7, T0 + 1, "accept", user="regular")
        judged(t, "g2", 7, T0 + 2, "accept", user="puppet")  # an id made up after the start
        t.close(LATER)
        assert outcomes(t)["canary"] == counted
        assert t.left_apart()["new_users"] == (0 if count_new else 1)


def test_a_window_is_read_its_length_plus_settle_after_the_first_answer_and_waits_for_reward():
    t = tally(windows=Windows(window_s=10, settle_s=30))
    t.add_episode(episode("g1", 7, T0 + 1, "accept", user="ann"))
    t.close(T0 + 40.9)
    assert t.measurement(T0 + 41).canary.pending == 1 and outcomes(t)["canary"] == (0, 0, 0)
    t.close(T0 + 41)  # due; reward has not judged the accept yet: it waits (up to JUDGE_WAIT_S)
    assert t.measurement(T0 + 41).canary.pending == 1
    t.add_reward(reward("g1", 7, T0 + 1, user="ann"))
    t.close(T0 + 42)
    assert outcomes(t)["canary"] == (1, 1, 0) and t.measurement(T0 + 42).canary.pending == 0


# -- pairing -----------------------------------------------------------------------------------

def test_users_pair_in_the_order_of_their_first_answer_as_their_windows_are_read():
    t = tally(routed_at=T0)  # the canary answered from the start
    judged(t, "s2", 0, T0 + 2, "reject")  # arrives first, answered second
    judged(t, "s1", 0, T0 + 1, "accept")
    judged(t, "c1", 7, T0 + 3, "accept")
    t.close(T0 + 3)  # s1, s2, then c1 meets s2, the most recent waiting stable user: a canary win
    assert t.pairs() == PairCount(1, 1, 0)
    judged(t, "c2", 7, T0 + 4, "reject")  # meets s1: a loss
    assert t.pairs() == PairCount(1, 1, 0)  # not before its window is read
    t.close(T0 + 4)
    assert t.pairs() == PairCount(2, 1, 1)


def test_pairing_never_looks_at_the_outcomes():
    # the same answers with the outcomes swapped pair the same users
    t = tally(routed_at=T0)  # the canary answered from the start
    for i, sig in enumerate(["reject", "accept", "reject", "accept"]):
        judged(t, f"s{i}", 0, T0 + 1 + 2 * i, sig)
        judged(t, f"c{i}", 7, T0 + 2 + 2 * i, "accept" if sig == "reject" else "reject")
    t.close(LATER)
    assert t.pairs() == PairCount(pairs=4, wins=2, losses=2)


ARMS6 = ("stable",) * 2 + ("canary",) * 4  # six users answered a second apart, in this order


def settle_order_pairs(accepted: tuple[bool, ...], reject_delay: float) -> PairCount:
    """The fold before outcome windows: each user's outcome paired when reward settled it (an
    accept a second after the answer, a reject ``reject_delay`` after)."""
    settle = sorted(range(6), key=lambda i: (i + (1 if accepted[i] else reject_delay), i))
    p = Pairing()
    for i in settle:
        p.add(ARMS6[i], accepted[i])
    return p.count


def windowed_pairs(accepted: tuple[bool, ...], reject_delay: float) -> PairCount:
    """The same users through the tally: episodes arrive in the order reward settles them."""
    t = tally(routed_at=T0)  # the canary answered from the start
    for i in sorted(range(6), key=lambda i: (i + (1 if accepted[i] else reject_delay), i)):
        judged(t, f"g{i}", 7 if ARMS6[i] == "canary" else 0, T0 + i, "accept" if accepted[i] else "reject")
    t.close(LATER)
    return t.pairs()


def test_rejects_settling_late_bias_pairs_in_settle_order_and_not_pairs_by_first_answer():
    """Identical versions: every user accepts with probability 1/2, whichever arm. Summed over all
    64 equally likely outcomes of six users, a valid pairing has as many canary wins as losses.
    Paired as reward settled them, with rejects 20 s late, accepts jumped the queue and took the
    waiting partners: 48 of the 56 discordant pairs went to the canary (the false PASSes of issue
    45). Read in windows and paired by first answer: as many wins as losses, and every result is
    that of pairing by first answer, whenever the feedback came."""
    old = new = PairCount()
    for accepted in itertools.product((True, False), repeat=6):
        a, b = settle_order_pairs(accepted, 20), windowed_pairs(accepted, 20)
        assert b == windowed_pairs(accepted, 0)  # when feedback arrives changes nothing
        old = PairCount(old.pairs + a.pairs, old.wins + a.wins, old.losses + a.losses)
        new = PairCount(new.pairs + b.pairs, new.wins + b.wins, new.losses + b.losses)
    assert (old.wins, old.losses) == (48, 8)
    assert new.wins == new.losses and new.pairs == 64 * 2


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


def fold(t: Tally, i: int, rec: tuple[str, EpisodeEvent | RewardEvent]) -> None:
    (t.add_episode if rec[0] == "e" else t.add_reward)(rec[1])
    if i % 10 == 9:
        t.close(T0 + i / 4)  # the controller's turns, each reading the windows due


def test_a_saved_tally_resumes_exactly_and_its_pairs_only_grow(monkeypatch):
    monkeypatch.setattr(measure, "DEDUPE_IDS", 50)
    recs = random_records(3, 300)
    whole, counts = tally(alpha=0.02, windows=Windows(window_s=5, settle_s=5, count_new_users=False)), []
    for i, rec in enumerate(recs):
        whole.add_episode(episode(f"pre{i}", 0, T0 - 1, "ignore", user=f"u{i}"))  # known before the start
    for i, rec in enumerate(recs):
        fold(whole, i, rec)
        counts.append(whole.pairs())
    assert counts[-1].pairs > 5
    assert all(b.pairs >= a.pairs and b.wins >= a.wins and b.losses >= a.losses
               for a, b in itertools.pairwise(counts))
    resumed = tally(alpha=0.02, windows=Windows(window_s=5, settle_s=5, count_new_users=False))
    for i, rec in enumerate(recs):
        resumed.add_episode(episode(f"pre{i}", 0, T0 - 1, "ignore", user=f"u{i}"))
    for i, rec in enumerate(recs):
        if i % 37 == 0:  # saved with the candidate as JSON, then read back by a restarted controller
            resumed = Tally.from_dict(json.loads(json.dumps(resumed.to_dict())))
        fold(resumed, i, rec)
        assert resumed.pairs() == counts[i]
    assert resumed.to_dict() == whole.to_dict() and resumed.alpha == 0.02
    whole.close(LATER)
    assert whole.measurement(LATER).excluded_users == 1  # u3
    # the dedupe window is bounded, and the restored one remembers the same ids
    assert len(resumed.seen_episodes) == 50


def test_a_tally_saved_before_outcome_windows_keeps_its_pairs_and_its_waiting_users_enter_again():
    t = tally(routed_at=T0)  # the canary answered from the start
    judged(t, "s1", 0, T0 + 1, "reject")
    judged(t, "c1", 7, T0 + 2, "accept")
    t.close(LATER)
    old = t.to_dict()
    del old["windows"]
    old["users"]["waiting"] = "pending"  # an outcome the old fold kept waiting for its reward
    old["pending"], old["early"] = {"g9": ["stable", True, "waiting"]}, {}
    back = Tally.from_dict(json.loads(json.dumps(old)))
    assert back.pairs() == PairCount(1, 1, 0) and back.windows == Windows()
    judged(back, "g10", 0, LATER + 1, "accept", user="waiting")
    back.close(LATER + 2)
    assert outcomes(back)["stable"] == (2, 1, 1)


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
    v = judge_canary(replace(t.measurement(T0 + 99), look=1), CanaryPolicy.of(ReleaseSettings(min_events=50)))
    assert v.outcome == Outcome.FAIL
    assert [r.split(" 0.")[0] for r in v.reasons] == ["guardrail character repetition",
                                                      "guardrail character-class stuffing: consonants",
                                                      "guardrail repetition anywhere in the answer:"], v.reasons


def test_the_profiles_are_saved_with_the_tally():
    t = tally()
    t.add_episode(episode("c", 7, T0 + 1, "ignore", text="aaa eee"))
    back = Tally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.arms["canary"].text == t.arms["canary"].text and back.arms["canary"].text.answers == 1
    saved = t.to_dict()
    for arm in saved["arms"].values():
        del arm["text"]  # saved before the profiles were kept: they start from there
    assert Tally.from_dict(saved).arms["canary"].text.answers == 0


# -- the sample-ratio check's users ------------------------------------------------------------


def srm_held(t: Tally) -> bool:
    from release.judge import sample_ratio_mismatch

    return sample_ratio_mismatch(t.measurement(LATER), srm_alpha=0.001) is not None


def test_users_before_the_canarys_first_generation_are_not_in_the_sample_ratio_check():
    """The tally starts before serving applies the routing: its first users all land on stable.
    Counted, 100 of them hold a correct canary at share 0.5; the check counts only users whose first
    generation came at or after the canary's first, in whatever order the records arrive."""
    gap = [episode(f"g{i}", 0, T0 + i, "accept", user=f"early-{i}") for i in range(100)]
    routed = [episode(f"r{i}", 0 if i % 2 else 7, T0 + 100 + i, "accept", user=f"u-{i}") for i in range(100)]
    t = tally(share=0.5)
    for ep in routed[::-1] + gap:  # the canary's later generations first: its first comes last
        t.add_episode(ep)
    t.close(LATER)
    assert t.routed_at == T0 + 100 and t.routed_users() == (50, 50)
    assert t.arms["stable"].per_user().users == 150  # still in the arms, the guardrails and the verdict
    assert not srm_held(t)
    assert Tally.from_dict(json.loads(json.dumps(t.to_dict()))).routed_users() == (50, 50)
    # a real mismatch after the routing is still held: 60 more users, all on stable
    for i in range(60):
        t.add_episode(episode(f"m{i}", 0, T0 + 300 + i, "accept", user=f"m-{i}"))
    t.close(LATER)
    assert t.routed_users() == (50, 110) and srm_held(t)


def test_a_user_answered_before_the_canarys_first_answer_counts_from_their_next_window():
    """Every user active as a canary starts answers before serving has loaded it (minutes, with an
    object store's fetch). Their first window is not counted; one outcome a user for the whole
    canary would have left a small deployment's canary with no users to judge."""
    t = tally(windows=Windows(window_s=5, settle_s=5))
    judged(t, "g1", 0, T0 + 1, "reject", user="ann")  # in the gap: stable whatever her hash
    judged(t, "g2", 7, T0 + 3, "accept", user="bob")  # the canary's first answer
    t.close(T0 + 20)
    # no outcome on stable (her reject still counts among the requests, for the guardrails)
    assert t.left_apart()["before_routing_users"] == 1 and outcomes(t)["stable"] == (0, 0, 1)
    judged(t, "g3", 7, T0 + 30, "accept", user="ann")  # her next answer, on her own arm
    t.close(T0 + 50)
    assert outcomes(t)["canary"] == (2, 2, 0) and t.users["ann"] == "counted"
    back = Tally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.left_apart()["before_routing_users"] == 1


def test_the_sample_ratio_counts_users_once_their_episodes_settled_not_as_they_arrive():
    """Rated answers' episodes leave ingest at once (early emission), unrated ones when their join
    window closes: a canary whose users accept reached the topic first. Counted on arrival, 40
    canary users against 0 on stable held a correct canary; counted once settled, neither arm is
    counted before the other's episodes are in."""
    t = tally(share=0.5, windows=Windows(settle_s=30))
    t.add_episode(episode("first", 7, T0, "accept", user="first"))  # the canary's first generation
    for i in range(40):  # accepted at once: on the topic within a second
        t.add_episode(episode(f"c{i}", 7, T0 + 1 + i / 10, "accept", user=f"c-{i}"))
    t.close(T0 + 10)
    assert t.routed_users() == (0, 0) and not srm_held(t)
    for i in range(40):  # not rated: on the topic when their join window closes, 30 s on
        t.add_episode(episode(f"s{i}", 0, T0 + 1 + i / 10, "ignore", user=f"s-{i}"))
    t.close(T0 + 40)
    assert t.routed_users() == (41, 40) and not srm_held(t)


def test_a_tally_saved_before_routed_at_counts_every_user_for_the_sample_ratio():
    t = tally(share=0.5)
    for i in range(40):
        t.add_episode(episode(f"g{i}", 0, T0 + i, "accept", user=f"u-{i}"))
    old = t.to_dict()
    del old["routed_at"], old["first_at"]
    assert Tally.from_dict(old).routed_users() == (0, 40) and srm_held(Tally.from_dict(old))
