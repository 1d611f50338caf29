"""Measuring a canary against stable from the event streams (judging is release/judge.py).

Episodes carry the version that produced them (``generation.model_version``): each episode of a
generation made after the canary started is counted for its arm, canary or stable; other versions
are not in the comparison. Rewards carry the version too, and their guard flags are counted the
same way. A :class:`Tally` is a plain fold over those records, so it can be saved with the
candidate (with the topic offsets it covers, in one transaction) and a restarted controller goes
on where it stopped.

Outcomes are the explicit signals: ``accept`` is an accept; ``reject`` and ``edit`` are not (an
edit is a partial accept at best, and the accept rate is what the canary promises to lift);
``ignore`` is no outcome. Each user counts for at most ``max_per_user`` outcomes: with sticky
routing one very active user would otherwise dominate an arm. Repeats (topics are at least once)
are dropped by generation id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from release.judge import ArmStats, CanaryMeasurement
from release.sequential import PairCount

ARMS = ("stable", "canary")


@dataclass
class Arm:
    outcomes: list[bool] = field(default_factory=list)
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
        return ArmStats(outcomes=len(self.outcomes), accepts=sum(self.outcomes), rejects=self.rejects,
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
    max_per_user: int = 50
    arms: dict[str, Arm] = field(default_factory=lambda: {a: Arm() for a in ARMS})
    seen_episodes: set[str] = field(default_factory=set)
    seen_rewards: set[str] = field(default_factory=set)
    #: topic -> partition -> next offset, saved with the tally
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    errors: int = 0  # measurements that failed (judge rule 1)
    history: list[dict[str, float]] = field(default_factory=list)

    def arm_of(self, version: int) -> str | None:
        if version == self.canary_version:
            return "canary"
        if version == self.stable_version:
            return "stable"
        return None

    def add_episode(self, ep: dict[str, Any]) -> None:
        """Fold one episode record (decoded JSON) in."""
        g = ep["generation"]
        gid = g["generation_id"]
        if gid in self.seen_episodes or g["created_at"] < self.started_at:
            return
        arm_name = self.arm_of(int(g["model_version"]))
        if arm_name is None:
            return
        self.seen_episodes.add(gid)
        arm = self.arms[arm_name]
        arm.requests += 1
        arm.errors += g.get("finish_reason") == "abort"
        arm.latencies_ms.append(float(g.get("latency_ms", 0.0)))
        arm.tokens += len(g.get("completion_token_ids", ()))
        signal = ep.get("signal")
        if signal in ("accept", "reject", "edit"):
            user = ep.get("rater_id") or g["user_id"]
            if arm.per_user.get(user, 0) < self.max_per_user:
                arm.per_user[user] = arm.per_user.get(user, 0) + 1
                arm.outcomes.append(signal == "accept")
                arm.rejects += signal == "reject"

    def add_reward(self, rw: dict[str, Any]) -> None:
        gid = rw["generation_id"]
        if gid in self.seen_rewards:
            return
        arm_name = self.arm_of(int(rw["model_version"]))
        if arm_name is None:
            return
        self.seen_rewards.add(gid)
        arm = self.arms[arm_name]
        arm.rewards += 1
        arm.flagged += bool(rw.get("flags"))

    def pairs(self) -> PairCount:
        count = PairCount()
        for c, s in zip(self.arms["canary"].outcomes, self.arms["stable"].outcomes):
            count = count.add(c, s)
        return count

    def measurement(self, now: float) -> CanaryMeasurement:
        return CanaryMeasurement(stable=self.arms["stable"].stats(), canary=self.arms["canary"].stats(),
                                 pairs=self.pairs(), elapsed_s=now - self.started_at,
                                 measurement_errors=self.errors)

    # -- saved with the candidate ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_version": self.stable_version, "canary_version": self.canary_version,
            "started_at": self.started_at, "max_per_user": self.max_per_user,
            "arms": {name: {"outcomes": [int(o) for o in a.outcomes], "rejects": a.rejects,
                            "requests": a.requests, "errors": a.errors,
                            "latencies_ms": a.latencies_ms, "tokens": a.tokens, "flagged": a.flagged,
                            "rewards": a.rewards, "per_user": a.per_user} for name, a in self.arms.items()},
            "seen_episodes": sorted(self.seen_episodes), "seen_rewards": sorted(self.seen_rewards),
            "offsets": {t: {str(p): n for p, n in parts.items()} for t, parts in self.offsets.items()},
            "errors": self.errors, "history": self.history,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        arms = {name: Arm([bool(o) for o in a["outcomes"]], a.get("rejects", 0), a["requests"], a["errors"],
                          a["latencies_ms"], a["tokens"], a["flagged"], a["rewards"], dict(a["per_user"]))
                for name, a in d["arms"].items()}
        return cls(d["stable_version"], d["canary_version"], d["started_at"], d.get("max_per_user", 50), arms,
                   set(d["seen_episodes"]), set(d["seen_rewards"]),
                   {t: {int(p): n for p, n in parts.items()} for t, parts in d["offsets"].items()},
                   d.get("errors", 0), d.get("history", []))
