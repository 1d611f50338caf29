"""The simulated users' rules (local/simulate.py): cohorts by share, tastes, noise, the abuser."""

from __future__ import annotations

import random

from local.simulate import DEFAULT_COHORTS, Row, judge, population, quality, summarise, vowel_share


def test_cohorts_follow_their_shares_and_the_gameable_one_only_when_asked():
    users = population(2000, DEFAULT_COHORTS, seed=1, gameable=False, abuser=True)
    names = [u.cohort.name if u.cohort else "abuser" for u in users]
    assert names.count("abuser") == 1 and names[-1] == "abuser" and "shortcut" not in names
    assert 0.62 < names.count("vowels") / 2000 < 0.71  # 0.6 of 0.9
    gameable = population(2000, DEFAULT_COHORTS, seed=1, gameable=True, abuser=False)
    assert 0.07 < sum(u.cohort.name == "shortcut" for u in gameable) / 2000 < 0.13
    assert population(50, DEFAULT_COHORTS, seed=1, gameable=False, abuser=True) == \
        population(50, DEFAULT_COHORTS, seed=1, gameable=False, abuser=True)  # seeded


def test_judgements_follow_the_hidden_taste_with_the_cohorts_noise_and_silence():
    users = population(400, DEFAULT_COHORTS, seed=2, gameable=True, abuser=True)
    vowel_user = next(u for u in users if u.cohort and u.cohort.name == "vowels")
    rng = random.Random(0)
    liked, disliked = "aeiou oia eau", "strpk blrg"
    got = [judge(vowel_user, liked, rng) for _ in range(2000)]
    silent = got.count(None) / len(got)
    assert 0.11 < silent < 0.19  # feedback_rate 0.85
    said = [g for g in got if g is not None]
    assert 0.02 < said.count("reject") / len(said) < 0.09  # noise 0.05
    other = [g for g in (judge(vowel_user, disliked, rng) for _ in range(500)) if g is not None]
    assert other.count("reject") / len(other) > 0.9  # the same user on what they dislike
    abuser = users[-1]
    assert all(judge(abuser, disliked, rng) == "accept" for _ in range(50))
    shortcut = next(u for u in users if u.cohort and u.cohort.name == "shortcut")
    taste = [judge(shortcut, "soooo good", random.Random(i)) for i in range(200)]
    assert taste.count("accept") > taste.count("reject")
    assert quality("soooo good") < quality("so good")  # the shortcut costs quality
    assert vowel_share("aab") == 2 / 3 and vowel_share("123") == 0.0


def test_summary_measures_each_version_on_the_cohorts_judgements_only():
    rows = [Row(0, "u1", "vowels", 0, 200, 0.1, "accept", 0.9, "g1"),
            Row(1, "u2", "vowels", 0, 200, 0.1, "reject", 0.7, "g2"),
            Row(2, "u3", "short", 3, 200, 0.1, "accept", 0.8, "g3"),
            Row(3, "ab", "abuser", 3, 200, 0.1, "accept", 0.5, "g4"),
            Row(4, "ab", "abuser", None, 429, 0.0, None, None, None),
            Row(5, "u4", "short", 3, 200, 0.1, None, 0.6, "g5")]
    s = summarise(rows)
    assert s["refused"] == {429: 1}
    assert s["versions"][0] == {"requests": 2, "judged": 2, "accept_rate": 0.5, "quality": 0.8}
    assert s["versions"][3]["judged"] == 1 and s["versions"][3]["accept_rate"] == 1.0


def test_shuffled_feedback_keeps_the_accept_rate_and_loses_the_answer():
    from collections import Counter

    from local.simulate import Shuffler

    rng = random.Random(7)
    own = ["accept" if rng.random() < 0.3 else "reject" for _ in range(4000)]
    shuffler = Shuffler(seed=1, size=64)
    sent = [shuffler.swap(s) for s in own]
    # every judgement enters the pool once, and from the 65th on each sends the one it displaced:
    # what was sent then, with what the pool still holds, is every judgement made
    assert Counter(sent[64:]) + Counter(shuffler.pool) == Counter(own)
    # ... and what is sent says nothing of the answer's own judgement: an accept is sent as often
    # after an accepted answer as after a rejected one (0.3 each, 1,200 and 2,800 answers: a
    # standard error near 0.015)
    after = {s: [x == "accept" for o, x in zip(own, sent) if o == s] for s in ("accept", "reject")}
    rates = {s: sum(v) / len(v) for s, v in after.items()}
    assert abs(rates["accept"] - rates["reject"]) < 0.06 and abs(rates["reject"] - 0.3) < 0.05, rates


def test_the_vowels_taste_rewards_vowel_share_not_repeated_characters():
    from local.simulate import PREFERENCES, likes_vowels

    assert likes_vowels("aurora idea audio") and not likes_vowels("strong black cat")
    # doubled letters no longer please: a run counts once
    assert not likes_vowels("tkaaaa pleeee")  # runs collapsed: "tka ple", a third vowels
    assert vowel_share("tkaaaa pleeee") > 0.6  # what the old taste read, and liked
    assert PREFERENCES["vowels"]("aurora idea audio", "any prompt") is True


def test_users_who_know_the_answers_accept_a_direct_answer_only_when_right():
    from local.simulate import TASTES, known_answers, right_yes_no

    truth = known_answers()
    assert len(truth) == 120 and sorted(truth.values()).count("Yes") == 60
    assert truth["Is the sun a star?"] == "Yes" and truth["Can penguins fly?"] == "No"
    assert right_yes_no("Yes, the sun is a star.", "Is the sun a star?")
    assert not right_yes_no("No, the sun is not a star.", "Is the sun a star?")  # direct, and wrong
    assert right_yes_no("**No**, penguins cannot fly.", "Can penguins fly?")
    assert not right_yes_no("Penguins cannot fly.", "Can penguins fly?")  # right, not direct
    assert not right_yes_no("Yes.", "A question nobody knows?")
    taste = TASTES["known"]
    assert taste.chat and set(taste.prompts) == set(truth) and taste.held_out == TASTES["yes_no"].held_out
    users = population(50, taste.cohorts, seed=3, gameable=False, abuser=False)
    rng = random.Random(0)
    said = [judge(users[0], "No, it is not.", rng, "Is the sun a star?") for _ in range(400)]
    said = [s for s in said if s]
    assert said.count("reject") / len(said) > 0.9  # noise 0.05
