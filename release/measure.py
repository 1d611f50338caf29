"""Measuring a canary against stable from the event streams (judging is release/judge.py).

A :class:`Tally` is a fold over the episodes and rewards read since the canary started: saved with
the candidate (with the topic offsets it covers, in one transaction), so a restarted controller
goes on exactly where it stopped. What it does with each record:

- **Arms.** Episodes carry the version that produced them (``generation.model_version``): a
  generation made after the canary started is counted for its arm, canary or stable, which is
  the arm serving's salted hash put its user in (serving/routing.py); other versions, and
  evaluation traffic that named its version (``route == "pinned"``), are in neither arm.
  Requests, errors, latencies and output length are counted per arm, as are rewards and their
  hacking flags (``long``, ``repetition``: about the answer), and the answers served are folded
  into a :class:`~flywheel.degeneracy.TextProfile` per arm (fixed-size sums: character repetition,
  character classes, a histogram of lengths) for the degeneracy guardrails; an aborted generation
  is an error, not an answer.
- **Who counts.** Abuse flags (:data:`~flywheel.contracts.ABUSE_FLAGS`: ``user_cap``,
  ``constant_user``, ``rate_anomaly``) describe the user who sent a signal (the episode's
  ``rater_id``, else the generation's user). A user reward flags on any of their rewards (any
  version, any time) is excluded from this canary's comparison from then on: their signals are
  neither outcomes nor rejects. The exclusions are counted and shown (:class:`Counts`).
- **One outcome per user per canary**: their first explicit signal (``accept`` is an accept,
  ``reject`` and ``edit`` are not, ``ignore`` is none). Users, not requests, are what the hash
  assigns to an arm, and one user's outcomes are correlated: counted ten times each, a few heavy
  users of differing taste (or one abusive user) moved verdicts far more often than alpha.
- **Settling.** An outcome counts once reward has judged its signal, when the reward record of
  its generation arrives (before or after the episode): dropped if that reward or an earlier one
  flagged the user, else folded into the pairs. So a flag on the signal itself always comes in
  time; a user flagged only after their outcome counted keeps it (a pair once formed is never
  rebuilt) and is counted apart (``flagged_after_counting``). An outcome reward never judges
  (the labeler failed, or reward is down) waits, shown as ``pending``, and is given up after
  ``MAX_PENDING`` newer ones.
- **Pairs** (release/sequential.py :class:`~release.sequential.Pairing`): outcomes in the order
  they settle, each meeting the most recent waiting outcome of the other arm. **Late feedback**
  follows the same rule: an outcome counts when it settles, whenever its generation was made
  after the canary started, and pairs with what waits then; it never moves a pair already
  formed. A generation made before the canary started never counts, however late its feedback.

Repeats (topics are at least once) are dropped by generation id, within a bounded window of ids
(a repeat arrives soon after its original: ``DEDUPE_IDS``). Latencies are kept as a bounded
sample (``LATENCY_SAMPLE``) for the p95.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flywheel.contracts import ABUSE_FLAGS, HACKING_FLAGS, EpisodeEvent, RewardEvent
from flywheel.degeneracy import TextProfile
from release.judge import ArmStats, CanaryMeasurement
from release.sequential import PairCount, Pairing

ARMS = ("stable", "canary")
#: Generation ids remembered per stream to drop repeats (a repeat follows its original within
#: one stage restart: far fewer records than this).
DEDUPE_IDS = 200_000
#: Latencies kept per arm for the p95 (the most recent).
LATENCY_SAMPLE = 5_000
#: Outcomes kept waiting for reward's judgement; past it the oldest is given up (its user may
#: count with a later signal: which one depends on reward's records arriving, never on what the
#: user said).
MAX_PENDING = 50_000
#: Rewards kept that came before their episode (the two topics are read side by side).
MAX_EARLY = 20_000

#: A user's state in one canary (``Tally.users``).
PENDING, COUNTED, EXCLUDED, FLAGGED_LATE = "pending", "counted", "excluded", "flagged_after_counting"


@dataclass
class Arm:
    #: settled outcomes counted (one per user), and the accepts among them
    outcomes: int = 0
    accepts: int = 0
    rejects: int = 0
    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    flagged: int = 0
    rewards: int = 0
    #: outcomes dropped because reward's guards flagged their user
    excluded: int = 0
    #: the answers served (module docstring)
    text: TextProfile = field(default_factory=TextProfile)

    def stats(self, pending: int = 0) -> ArmStats:
        lat = sorted(self.latencies_ms)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0
        return ArmStats(outcomes=self.outcomes, accepts=self.accepts, rejects=self.rejects, requests=self.requests,
                        errors=self.errors, latency_ms_p95=p95,
                        completion_tokens_mean=self.tokens / self.requests if self.requests else 0.0,
                        flagged=self.flagged, rewards=self.rewards, excluded=self.excluded, pending=pending,
                        text=self.text)


@dataclass
class Tally:
    """Everything measured for one canary so far."""

    stable_version: int
    canary_version: int
    started_at: float
    #: the level this canary's PASS is tested at (the deployment's budget, release/sequential.py
    #: ``canary_alpha``), fixed when it started; None: ``release.alpha``
    alpha: float | None = None
    arms: dict[str, Arm] = field(default_factory=lambda: {a: Arm() for a in ARMS})
    pairing: Pairing = field(default_factory=Pairing)
    #: user -> PENDING, COUNTED, EXCLUDED or FLAGGED_LATE (module docstring)
    users: dict[str, str] = field(default_factory=dict)
    #: generation id -> [arm, accepted, user] of outcomes waiting for their reward, oldest first
    pending: dict[str, list[Any]] = field(default_factory=dict)
    #: generation id -> whether its reward flagged the user, for rewards ahead of their episode
    early: dict[str, bool] = field(default_factory=dict)
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
        #: users in each state, kept as they change (the judge reads them after every record)
        self._states = {s: 0 for s in (PENDING, COUNTED, EXCLUDED, FLAGGED_LATE)}
        for state in self.users.values():
            self._states[state] += 1

    def _set(self, user: str, state: str | None) -> None:
        """Move ``user`` to ``state`` (None: forget them)."""
        old = self.users.pop(user, None)
        if old is not None:
            self._states[old] -= 1
        if state is not None:
            self.users[user] = state
            self._states[state] += 1

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

    # -- the fold ----------------------------------------------------------------------------
    def add_episode(self, ep: EpisodeEvent) -> None:
        """Fold one episode record (decoded through the contract: release/streams.py) in."""
        g = ep.generation
        if g.created_at < self.started_at or g.route == "pinned":
            return  # before the canary, or evaluation traffic that named its version: no user's arm
        arm_name = self.arm_of(g.model_version)
        if arm_name is None or not self._first("episodes", g.generation_id):
            return
        arm = self.arms[arm_name]
        arm.requests += 1
        arm.errors += g.finish_reason == "abort"
        arm.latencies_ms.append(g.latency_ms)
        del arm.latencies_ms[:-LATENCY_SAMPLE]
        arm.tokens += len(g.completion_token_ids)
        if g.finish_reason != "abort":
            arm.text = arm.text.add(g.completion_text)
        gid, signal = g.generation_id, ep.signal
        judged = self.early.pop(gid, None)  # reward's judgement, when it came first
        user = ep.rater_id or g.user_id
        if signal not in ("accept", "reject", "edit") or self.users.get(user) in (EXCLUDED, FLAGGED_LATE):
            return
        arm.rejects += signal == "reject"
        if user in self.users:
            return  # one outcome per user per canary
        outcome = [arm_name, signal == "accept", user]
        self._set(user, PENDING)
        if judged is not None:
            self._settle(outcome, judged)
            return
        self.pending[gid] = outcome
        if len(self.pending) > MAX_PENDING:
            oldest = next(iter(self.pending))
            self._set(self.pending.pop(oldest)[2], None)

    def add_reward(self, rw: RewardEvent) -> None:
        """Fold one reward record (decoded through the contract: release/streams.py) in."""
        gid = rw.generation_id
        if not self._first("rewards", gid):
            return
        abusive = any(f in ABUSE_FLAGS for f in rw.flags)
        if abusive:  # whatever the version or time: it says who the user is
            self._exclude(rw.rater_id or rw.user_id)
        arm_name = self.arm_of(rw.model_version) if rw.generated_at >= self.started_at else None
        if gid in self.pending:
            self._settle(self.pending.pop(gid), abusive)
        elif arm_name is not None and gid not in self._seen["episodes"]:
            self.early[gid] = abusive  # its episode is still to come
            if len(self.early) > MAX_EARLY:
                del self.early[next(iter(self.early))]
        if arm_name is None:
            return  # a generation from before the canary, or of neither arm: no guardrail count
        arm = self.arms[arm_name]
        arm.rewards += 1
        # only flags about the answer count against a version: abuse flags describe the user
        arm.flagged += any(f in HACKING_FLAGS for f in rw.flags)

    def _exclude(self, user: str) -> None:
        state = self.users.get(user)
        if state == COUNTED:
            self._set(user, FLAGGED_LATE)
        elif state not in (EXCLUDED, FLAGGED_LATE):
            self._set(user, EXCLUDED)  # a pending outcome of theirs is dropped when it settles

    def _settle(self, outcome: list[Any], abusive: bool) -> None:
        arm_name, accepted, user = outcome
        arm = self.arms[arm_name]
        if abusive or self.users.get(user) == EXCLUDED:
            self._set(user, EXCLUDED)
            arm.excluded += 1
            return
        self._set(user, COUNTED)
        arm.outcomes += 1
        arm.accepts += accepted
        self.pairing.add(arm_name, accepted)

    # -- what the judge reads ----------------------------------------------------------------
    def pairs(self) -> PairCount:
        return self.pairing.count

    def measurement(self, now: float) -> CanaryMeasurement:
        pending = {a: 0 for a in ARMS}
        for arm_name, _, _ in self.pending.values():
            pending[arm_name] += 1
        late = self._states[FLAGGED_LATE]
        return CanaryMeasurement(stable=self.arms["stable"].stats(pending["stable"]),
                                 canary=self.arms["canary"].stats(pending["canary"]), pairs=self.pairs(),
                                 elapsed_s=now - self.started_at, measurement_errors=self.errors,
                                 excluded_users=self._states[EXCLUDED] + late, flagged_after_counting=late)

    # -- saved with the candidate ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_version": self.stable_version, "canary_version": self.canary_version,
            "started_at": self.started_at, "alpha": self.alpha,
            "arms": {name: {"outcomes": a.outcomes, "accepts": a.accepts, "rejects": a.rejects,
                            "requests": a.requests, "errors": a.errors, "latencies_ms": a.latencies_ms,
                            "tokens": a.tokens, "flagged": a.flagged, "rewards": a.rewards, "excluded": a.excluded,
                            "text": a.text.to_dict()}
                     for name, a in self.arms.items()},
            "pairing": self.pairing.to_dict(), "users": self.users, "pending": self.pending,
            "early": self.early,
            "seen_episodes": list(self.seen_episodes), "seen_rewards": list(self.seen_rewards),
            "offsets": {t: {str(p): n for p, n in parts.items()} for t, parts in self.offsets.items()},
            "errors": self.errors, "history": self.history,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        # A tally saved by the previous fold (no "pairing": its pairs were rebuilt every tick from
        # a list sorted by generation time) keeps its offsets and guardrail counts; its accept-rate
        # test starts afresh from here, its outcomes not being pairs that can be resumed.
        folded = "pairing" in d
        arms = {name: Arm(a["outcomes"] if folded else 0, a["accepts"] if folded else 0, a.get("rejects", 0),
                          a["requests"], a["errors"], a["latencies_ms"], a["tokens"], a["flagged"], a["rewards"],
                          a.get("excluded", 0), TextProfile.from_dict(a["text"]) if "text" in a else TextProfile())
                for name, a in d["arms"].items()}
        return cls(d["stable_version"], d["canary_version"], d["started_at"], d.get("alpha"), arms,
                   Pairing.from_dict(d["pairing"]) if folded else Pairing(), dict(d.get("users", {})),
                   dict(d.get("pending", {})), dict(d.get("early", {})),
                   deque(d["seen_episodes"]), deque(d["seen_rewards"]),
                   {t: {int(p): n for p, n in parts.items()} for t, parts in d["offsets"].items()},
                   d.get("errors", 0), d.get("history", []))
