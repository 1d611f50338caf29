"""Guards against abuse and reward hacking: pure judging functions, table-tested.

Abuse, judged per user who sent the signal (the episode's ``rater_id``: the winning feedback's
user, or the generation's user when the feedback named none), over a tumbling window of
generation time (``guard_window_s``), from counts the reward stage keeps in its state store (per
process, over its shards, when the stage runs as several shard processes):

- ``user_cap``      a sample that would take the user's kept samples beyond
                    ``max(user_cap_min, user_cap_share x the window's kept samples)`` (this one
                    included) gets weight 0: one user cannot own more than their share of what a
                    window sends to training, however many samples they flood it with. A
                    timed-out episode sent to training (``emit_ignored``) counts toward its
                    generation user's kept samples and is capped with them, but is no signal:
                    it never makes anyone constant or anomalous.
- ``constant_user`` a user with at least ``constant_min_signals`` signals in the window, all the
                    same (accept on everything), is down-weighted by ``constant_weight``. Edits
                    never make a user constant: each is graded by how much the user changed, so
                    a user who only edits still tells samples apart.
- ``rate_anomaly``  a user with more than ``rate_factor`` x the mean count of the window's other
                    users (and at least ``rate_min``) is down-weighted by ``rate_weight``. The
                    others only: counted in the mean, a flooder raises the bar they are judged by,
                    and among ``rate_factor`` users or fewer could never pass it.

Reward hacking (what the model produced), judged per sample:

- ``long``: a completion past ``length_target_tokens``; it pays the ``length_penalty``
  component, ``-length_penalty`` per target length of excess tokens, down to
  ``-length_penalty_max``, so a policy cannot buy reward with verbosity.
- ``repetition``: a completion whose distinct n-gram ratio is below ``repetition_min_distinct``
  is degenerate; it pays ``repetition_penalty``. Token n-grams from ``repetition_min_tokens``
  tokens, and characters from ``repetition_min_chars``: the share of character pairs that are
  new (neither a doubled character nor a pair seen before; flywheel/degeneracy.py, the measure
  the release gate compares versions by). A gamed answer is often short (``aaa eee ooo`` is four
  tokens), and token n-grams say nothing under a dozen tokens.

Each is flagged whether or not its penalty is set (a penalty of 0 turns the penalty off, not
the guard's eyes): the flags still reach the metrics, the alerts and the archive.

Flagged samples are still emitted (weight may be 0): the flags are visible downstream, in the
metrics and in the archive, and the stream keeps one reward per episode.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

from flywheel.degeneracy import repetition
from flywheel.settings import RewardSettings

#: The components :func:`judge_sample` adds to a reward; labelers may not name their own so.
GUARD_COMPONENTS: frozenset[str] = frozenset({"length_penalty", "repetition_penalty"})


class UserWindow(NamedTuple):
    """Counts for one user in one guard window, including the sample being judged, except
    ``user_kept`` and ``window_kept``: the user's and the window's samples kept (not capped)
    before this one.

    Named tuples rather than frozen dataclasses, here and below: one of each is made per sample,
    and a frozen dataclass costs several times more to make.
    """

    user_count: int
    user_kept: int
    window_total: int
    window_users: int
    signal_counts: dict[str, int]
    window_kept: int


class Verdict(NamedTuple):
    weight: float
    flags: tuple[str, ...]


#: The verdict on most samples, made once.
CLEAN = Verdict(1.0, ())


def within_cap(user_kept: int, window_kept: int, cfg: RewardSettings) -> bool:
    """Whether one more kept sample of a user stays within ``user_cap`` (both counts before it)."""
    return user_kept + 1 <= max(cfg.user_cap_min, int(cfg.user_cap_share * (window_kept + 1)))


def judge_user(stats: UserWindow, cfg: RewardSettings) -> Verdict:
    """Weight and flags for a sample given its user's counts in the window."""
    flags: list[str] = []
    weight = 1.0
    if not within_cap(stats.user_kept, stats.window_kept, cfg):
        flags.append("user_cap")
        weight = 0.0
    counts = stats.signal_counts.values()
    if sum(counts) >= cfg.constant_min_signals and len([c for c in counts if c > 0]) == 1 \
            and not stats.signal_counts.get("edit"):
        flags.append("constant_user")
        weight *= cfg.constant_weight
    others = stats.window_users - 1
    mean = (stats.window_total - stats.user_count) / others if others else float("inf")
    if stats.user_count >= cfg.rate_min and stats.user_count > cfg.rate_factor * mean:
        flags.append("rate_anomaly")
        weight *= cfg.rate_weight
    return Verdict(weight, tuple(flags)) if flags else CLEAN


def judge_unrated(user_kept: int, window_kept: int, cfg: RewardSettings) -> Verdict:
    """A timed-out episode sent to training (``reward.emit_ignored``), for its generation's user.

    Nobody sent a signal, so nothing here says the user is constant or anomalous; but the sample
    still goes to training, so it counts toward the user's share, and the cap applies.
    """
    return CLEAN if within_cap(user_kept, window_kept, cfg) else Verdict(0.0, ("user_cap",))


def length_penalty(n_tokens: int, cfg: RewardSettings) -> float:
    excess = max(0, n_tokens - cfg.length_target_tokens)
    return -min(cfg.length_penalty * excess / cfg.length_target_tokens, cfg.length_penalty_max)


def distinct_ngram_ratio(tokens: tuple[int, ...], n: int) -> float:
    """Distinct n-grams / n-grams; 1.0 when there are none (too short to judge)."""
    count = len(tokens) - n + 1
    if count <= 0:
        return 1.0
    # zip over n shifted views builds each n-gram tuple in C: several times cheaper per sample
    # (the usual n spelled out: the generic form's generator costs as much as the set)
    if n == 3:
        grams = zip(tokens, tokens[1:], tokens[2:])
    elif n == 2:
        grams = pairwise(tokens)
    else:
        grams = zip(*(tokens[i:] for i in range(n)))
    return len(set(grams)) / count


def judge_sample(tokens: tuple[int, ...], cfg: RewardSettings,
                 text: str = "") -> tuple[dict[str, float], tuple[str, ...]]:
    """Reward-hacking guards for one completion (its token ids and its text): (extra components, flags)."""
    components: dict[str, float] = {}
    flags: list[str] = []
    long, repetitive = len(tokens) > cfg.length_target_tokens, _repetitive(tokens, text, cfg)
    if not long and not repetitive:
        return components, ()  # the usual sample: nothing to say
    if long:
        flags.append("long")
        if cfg.length_penalty:
            components["length_penalty"] = length_penalty(len(tokens), cfg)
    if repetitive:
        flags.append("repetition")
        if cfg.repetition_penalty:
            components["repetition_penalty"] = -cfg.repetition_penalty
    return components, tuple(flags)


def _repetitive(tokens: tuple[int, ...], text: str, cfg: RewardSettings) -> bool:
    """Too few distinct token n-grams, or character pairs (module docstring)."""
    if (len(tokens) >= cfg.repetition_min_tokens
            and distinct_ngram_ratio(tokens, cfg.repetition_ngram) < cfg.repetition_min_distinct):
        return True
    return len(text) >= cfg.repetition_min_chars and 1.0 - repetition(text) < cfg.repetition_min_distinct


def window_of(generated_at: float, cfg: RewardSettings) -> int:
    return int(generated_at // cfg.guard_window_s)
