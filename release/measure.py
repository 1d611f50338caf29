"""Measuring a canary against stable from the event streams (judging is release/judge.py).

Episodes carry the version that produced them (``generation.model_version``): each episode of a
generation made after the canary started is counted for its arm, canary or stable; other versions
are not in the comparison. Rewards carry the version too, and their reward-hacking flags
(``long``, ``repetition``) are counted the same way; abuse flags (``constant_user`` ...) are not:
they describe a user, and which arm a user lands in is the hash's doing, not the model's. A :class:`Tally` is a plain fold over those records, so it can be saved with the
candidate (with the topic offsets it covers, in one transaction) and a restarted controller goes
on where it stopped.

Outcomes are the explicit signals: ``accept`` is an accept; ``reject`` and ``edit`` are not (an
edit is a partial accept at best, and the accept rate is what the canary promises to lift);
``ignore`` is no outcome.

What keeps the sequential test valid (release/sequential.py):

- **One outcome per user** by default (``outcomes_per_user``): users, not requests, are what the
  hash assigns to an arm, and one user's outcomes are correlated; counted many times, a few
  heavy users of differing taste make the two arms differ by chance far more often than alpha.
  Each user's first outcomes are independent across users, so the pairs stay independent.
- **Pairs close in time**: each canary outcome is paired with the first stable outcome made at or
  after it (in the generations' own time), and stable outcomes in between are left unpaired. At a
  10% canary share, pairing by arrival count would put a canary outcome next to a stable one from
  far earlier, and any drift of the accept rate over the day would read as a difference.

Repeats (topics are at least once) are dropped by generation id, within a bounded window of ids
(a repeat arrives soon after its original: ``DEDUPE_IDS``). Latencies are kept as a bounded
sample (``LATENCY_SAMPLE``) for the p95.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flywheel.contracts import HACKING_FLAGS
from release.judge import ArmStats, CanaryMeasurement
from release.sequential import PairCount

ARMS = ("stable", "canary")
#: Generation ids remembered per stream to drop repeats (a repeat follows its original within
#: one stage restart: far fewer records than this).
DEDUPE_IDS = 200_000
#: Latencies kept per arm for the p95 (the most recent).
LATENCY_SAMPLE = 5_000


def _time(outcome: tuple[float, bool]) -> float:
    return outcome[0]


@dataclass
class Arm:
    #: (the generation's created_at, accepted) of each counted outcome
    outcomes: list[tuple[float, bool]] = field(default_factory=list)
    rejects: int = 0
    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    flagged: int = 0
    rewards: int = 0
    per_user: dict[str, int] = field(default_factory=dict)

    def stats(self) -> ArmStats:
        lat = sorted(self.latencies_ms)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0
        return ArmStats(outcomes=len(self.outcomes), accepts=sum(o for _, o in self.outcomes), rejects=self.rejects,
                        requests=self.requests,
                        errors=self.errors, latency_ms_p95=p95,
                        completion_tokens_mean=self.tokens / self.requests if self.requests else 0.0,
                        flagged=self.flagged, rewards=self.rewards)


@dataclass
class Tally:
    """Everything measured for one canary so far."""

    stable_version: int
    canary_version: int
    started_at: float
    outcomes_per_user: int = 1
    arms: dict[str, Arm] = field(default_factory=lambda: {a: Arm() for a in ARMS})
    seen_episodes: deque[str] = field(default_factory=deque)
    seen_rewards: deque[str] = field(default_factory=deque)
    #: topic -> partition -> next offset, saved with the tally
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    errors: int = 0  # measurements that failed in a row (judge rule 1)
    history: list[dict[str, float]] = field(default_factory=list)

    def arm_of(self, version: int) -> str | None:
        if version == self.canary_version:
            return "canary"
        if version == self.stable_version:
            return "stable"
        return None

    def __post_init__(self) -> None:
        self._seen = {"episodes": set(self.seen_episodes), "rewards": set(self.seen_rewards)}

    def _first(self, stream: str, gid: str) -> bool:
        """Whether ``gid`` is new on ``stream`` (remembering it, and forgetting the oldest)."""
        seen, order = self._seen[stream], self.seen_episodes if stream == "episodes" else self.seen_rewards
        if gid in seen:
            return False
        seen.add(gid)
        order.append(gid)
        if len(order) > DEDUPE_IDS:
            seen.discard(order.popleft())
        return True

    def add_episode(self, ep: dict[str, Any]) -> None:
        """Fold one episode record (decoded JSON) in."""
        g = ep["generation"]
        if g["created_at"] < self.started_at or g.get("route") == "pinned":
            return  # before the canary, or evaluation traffic that named its version: no user's arm
        arm_name = self.arm_of(int(g["model_version"]))
        if arm_name is None or not self._first("episodes", g["generation_id"]):
            return
        arm = self.arms[arm_name]
        arm.requests += 1
        arm.errors += g.get("finish_reason") == "abort"
        arm.latencies_ms.append(float(g.get("latency_ms", 0.0)))
        del arm.latencies_ms[:-LATENCY_SAMPLE]
        arm.tokens += len(g.get("completion_token_ids", ()))
        signal = ep.get("signal")
        if signal in ("accept", "reject", "edit"):
            arm.rejects += signal == "reject"
            user = ep.get("rater_id") or g["user_id"]
            if arm.per_user.get(user, 0) < self.outcomes_per_user:
                arm.per_user[user] = arm.per_user.get(user, 0) + 1
                # by time alone (ties keep arrival order): an order that looked at the outcome
                # would make the pairing look at it too
                bisect.insort(arm.outcomes, (float(g["created_at"]), signal == "accept"), key=_time)

    def add_reward(self, rw: dict[str, Any]) -> None:
        if float(rw.get("generated_at", self.started_at)) < self.started_at:
            return  # a generation from before the canary: not in the comparison
        arm_name = self.arm_of(int(rw["model_version"]))
        if arm_name is None or not self._first("rewards", rw["generation_id"]):
            return
        arm = self.arms[arm_name]
        arm.rewards += 1
        # only flags about the answer: abuse flags describe the user, and users are what the hash
        # puts in an arm, so one abusive user on the canary's side would read as a worse model
        arm.flagged += any(f in HACKING_FLAGS for f in rw.get("flags") or ())

    def pairs(self) -> PairCount:
        """Each canary outcome with the first stable outcome at or after it (module docstring)."""
        count, stable, j = PairCount(), self.arms["stable"].outcomes, 0
        for t, accepted in self.arms["canary"].outcomes:
            while j < len(stable) and stable[j][0] < t:
                j += 1
            if j == len(stable):
                break  # later canary outcomes wait for a stable partner
            count = count.add(accepted, stable[j][1])
            j += 1
        return count

    def measurement(self, now: float) -> CanaryMeasurement:
        return CanaryMeasurement(stable=self.arms["stable"].stats(), canary=self.arms["canary"].stats(),
                                 pairs=self.pairs(), elapsed_s=now - self.started_at,
                                 measurement_errors=self.errors)

    # -- saved with the candidate ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_version": self.stable_version, "canary_version": self.canary_version,
            "started_at": self.started_at, "outcomes_per_user": self.outcomes_per_user,
            "arms": {name: {"outcomes": [[t, int(o)] for t, o in a.outcomes], "rejects": a.rejects,
                            "requests": a.requests, "errors": a.errors,
                            "latencies_ms": a.latencies_ms, "tokens": a.tokens, "flagged": a.flagged,
                            "rewards": a.rewards, "per_user": a.per_user} for name, a in self.arms.items()},
            "seen_episodes": list(self.seen_episodes), "seen_rewards": list(self.seen_rewards),
            "offsets": {t: {str(p): n for p, n in parts.items()} for t, parts in self.offsets.items()},
            "errors": self.errors, "history": self.history,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        arms = {name: Arm([(float(t), bool(o)) for t, o in a["outcomes"]], a.get("rejects", 0), a["requests"],
                          a["errors"], a["latencies_ms"], a["tokens"], a["flagged"], a["rewards"], dict(a["per_user"]))
                for name, a in d["arms"].items()}
        return cls(d["stable_version"], d["canary_version"], d["started_at"], d.get("outcomes_per_user", 1), arms,
                   deque(d["seen_episodes"]), deque(d["seen_rewards"]),
                   {t: {int(p): n for p, n in parts.items()} for t, parts in d["offsets"].items()},
                   d.get("errors", 0), d.get("history", []))
