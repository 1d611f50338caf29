"""Measuring a canary against stable from the event streams (judging is release/judge.py).

A :class:`Tally` is a fold over the episodes and rewards read since the canary started: saved with
the candidate (with the topic offsets it covers, in one transaction), so each save is a consistent
snapshot of counts and offsets, and a restarted controller goes on from the last one, reading the
records after its offsets again (release/controller.py saves it every ``release.tally_save_s``, at
a verdict and at a guardrail look). What it does with each record:

- **Arms.** Episodes carry the version that produced them (``generation.model_version``): a
  generation made after the canary started is counted for its arm, canary or stable, which is
  the arm serving's salted hash put its user in (serving/routing.py); other versions, and
  evaluation traffic that named its version (``route == "pinned"``), are in neither arm.
  Requests, errors, latencies and output length are counted per arm, as are rewards and their
  hacking flags (``long``, ``repetition``: about the answer), and the answers served are folded
  into a :class:`~flywheel.degeneracy.TextProfile` per arm (fixed-size sums: character repetition,
  character classes, a histogram of lengths) for the degeneracy guardrails, and with their prompts
  into a :class:`~release.meaning.MeaningProfile` (first words, shared openings and closings,
  relevance, repetition anywhere, appended filler, distinct answers); an aborted generation is an
  error, not an answer.
- **Per user, for the guardrails.** Each arm also keeps, for each user the hash put in it (the
  generation's ``user_id``), their requests, errors, rejects, rewards and flagged rewards
  (``Arm.users``, at most ``MAX_GUARDRAIL_USERS``): the rate guardrails compare the means over
  users of each user's own rate, and the sample-ratio check counts the users per arm against the
  share the routing asked for (``Tally.share``), both in release/judge.py.
- **Who counts.** Abuse flags (:data:`~flywheel.contracts.ABUSE_FLAGS`: ``user_cap``,
  ``constant_user``, ``rate_anomaly``) describe the user who sent a signal (the episode's
  ``rater_id``, else the generation's user). A user reward flags on any of their rewards (any
  version, any time) is excluded from this canary's comparison from then on: their signals are
  neither outcomes nor rejects. The exclusions are counted and shown (:class:`Counts`).
- **One outcome per user per canary, read at a fixed time** (release/outcomes.py). A user's
  window opens at their first answer in the canary; their outcome is read
  ``release.outcome_window_s`` after it plus ingest's join window and grace (``settle_s``: an
  answer nobody rated leaves ingest only when its join window closes), whatever they said and
  whenever they said it: their first explicit signal on an answer in the window (``accept`` is an
  accept, ``reject`` and ``edit`` are not), **no signal is no accept**. Users, not requests, are
  what the hash assigns to an arm, and one user's outcomes are correlated: counted ten times each,
  a few heavy users of differing taste (or one abusive user) moved verdicts far more often than
  alpha. A signal someone gave on another user's answer (``rater_id``) is no one's outcome.
- **Reward's judgement.** A signal counts once reward has judged it (its reward record arrived),
  so a flag on the signal itself always comes in time; a user flagged while their window is open
  is dropped when it is read (``excluded``), one flagged only after their outcome counted keeps it
  (a pair once formed is never rebuilt) and is counted apart (``flagged_after_counting``). A
  window whose signal reward never judges waits ``JUDGE_WAIT_S`` and is given up (``unjudged``).
- **New users.** A user counts only if a generation of theirs made before the canary started
  reached the fold (``release.new_users = "exclude"``, the default): ids made up after the start
  are counted apart (``new``). ``"count"`` counts them.
- **Pairs** (release/sequential.py :class:`~release.sequential.Pairing`): users in the order of
  their first answer, as their windows are read, each meeting the most recent waiting user of the
  other arm: which users pair never depends on what, when or whether they answered. **Late
  feedback**: a signal whose episode arrives after its user's window was read counts for nothing
  (ingest itself drops feedback later than its join window), and a user whose first episode comes
  after later users were read is counted apart (``late``). A generation made before the canary
  started never counts, however late its feedback.

Repeats (topics are at least once) are dropped by generation id, within a bounded window of ids
(a repeat arrives soon after its original: ``DEDUPE_IDS``). Latencies are kept as a bounded
sample (``LATENCY_SAMPLE``) for the p95.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flywheel.contracts import ABUSE_FLAGS, HACKING_FLAGS, EpisodeEvent, RewardEvent
from flywheel.degeneracy import TextProfile
from release.judge import ArmStats, CanaryMeasurement, PerUser
from release.meaning import MeaningProfile
from release.outcomes import Kind, Read, Windows
from release.sequential import PairCount, Pairing

ARMS = ("stable", "canary")
#: Generation ids remembered per stream to drop repeats (a repeat follows its original within
#: one stage restart: far fewer records than this).
DEDUPE_IDS = 200_000
#: Latencies kept per arm for the p95 (the most recent).
LATENCY_SAMPLE = 5_000
#: Users whose own counts each arm keeps for the per-user guardrails (release/judge.py); past it a
#: new user is in no guardrail, and the sample-ratio check stops (one arm full, the other not, the
#: counts would read as a mismatch). A canary is decided long before 50,000 users on either arm.
MAX_GUARDRAIL_USERS = 50_000
#: Where each count sits in ``Arm.users[user]``: ``U_TOKENS`` and ``U_LATENCY`` are sums over the
#: user's generations (None in a tally saved before they were kept: that user is in neither mean).
U_REQUESTS, U_ERRORS, U_REJECTS, U_REWARDS, U_FLAGGED, U_TOKENS, U_LATENCY = range(7)

#: A user's state in one canary (``Tally.users``): their window is open (``pending``), read
#: (``counted``, or ``new``, ``unjudged`` or ``switched``: release/outcomes.py), or they are left out.
PENDING, COUNTED, EXCLUDED, FLAGGED_LATE = "pending", "counted", "excluded", "flagged_after_counting"
NEW, LATE, UNJUDGED, SWITCHED = Kind.NEW.value, "late", Kind.UNJUDGED.value, Kind.SWITCHED.value
STATES = (PENDING, COUNTED, EXCLUDED, FLAGGED_LATE, NEW, LATE, UNJUDGED, SWITCHED)


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
    meaning: MeaningProfile = field(default_factory=MeaningProfile)
    #: user -> [requests, errors, rejects, rewards, flagged, tokens, latency ms] of the generations
    #: made for them, for the per-user guardrails (at most ``MAX_GUARDRAIL_USERS``)
    users: dict[str, list[Any]] = field(default_factory=dict)

    def count(self, user: str, what: int, amount: float = 1) -> None:
        """Add ``amount`` to ``user``'s count ``what`` (a ``U_*`` index), if they are or can be kept."""
        counts = self.users.get(user)
        if counts is None:
            if len(self.users) >= MAX_GUARDRAIL_USERS:
                return
            counts = self.users[user] = [0, 0, 0, 0, 0, 0, 0.0]
        if counts[what] is not None:
            counts[what] += amount

    def per_user(self) -> PerUser:
        """Sums over users of each user's own rates (release/judge.py ``PerUser``)."""
        n = raters = 0
        err = err2 = rej = rej2 = flag = flag2 = length = 0.0
        lengths, latencies = 0, []
        for requests, errors, rejects, rewards, flagged, tokens, latency in self.users.values():
            if requests:
                n += 1
                e, r = errors / requests, min(rejects / requests, 1.0)
                err, err2, rej, rej2 = err + e, err2 + e * e, rej + r, rej2 + r * r
                if tokens is not None and latency is not None:
                    lengths, length = lengths + 1, length + tokens / requests
                    latencies.append(latency / requests)
            if rewards:
                raters += 1
                f = flagged / rewards
                flag, flag2 = flag + f, flag2 + f * f
        latencies.sort()
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else 0.0
        return PerUser(n, err, err2, rej, rej2, raters, flag, flag2, lengths, length, p95)

    def stats(self, pending: int = 0) -> ArmStats:
        lat = sorted(self.latencies_ms)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0
        return ArmStats(outcomes=self.outcomes, accepts=self.accepts, rejects=self.rejects, requests=self.requests,
                        errors=self.errors, latency_ms_p95=p95,
                        completion_tokens_mean=self.tokens / self.requests if self.requests else 0.0,
                        flagged=self.flagged, rewards=self.rewards, excluded=self.excluded, pending=pending,
                        text=self.text, meaning=self.meaning, per_user=self.per_user())


@dataclass
class Tally:
    """Everything measured for one canary so far."""

    stable_version: int
    canary_version: int
    started_at: float
    #: the level this canary's PASS is tested at (the deployment's budget, release/budget.py
    #: ``pass_level``), fixed when it started; None: ``release.alpha``
    alpha: float | None = None
    arms: dict[str, Arm] = field(default_factory=lambda: {a: Arm() for a in ARMS})
    pairing: Pairing = field(default_factory=Pairing)
    #: user -> one of ``STATES`` (module docstring)
    users: dict[str, str] = field(default_factory=dict)
    seen_episodes: deque[str] = field(default_factory=deque)
    seen_rewards: deque[str] = field(default_factory=deque)
    #: topic -> partition -> next offset, saved with the tally
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    errors: int = 0  # measurements that failed in a row (judge rule 1)
    history: list[dict[str, float]] = field(default_factory=list)
    #: each user's outcome window (release/outcomes.py), its length fixed as the canary started
    windows: Windows = field(default_factory=Windows)
    #: the canary share the routing asked for as the canary started (the sample-ratio check);
    #: None: not known (a tally saved by older code), not judged
    share: float | None = None
    #: guardrail looks taken so far (release/budget.py ``look_due``)
    guardrail_look: int = 0
    #: when the canary's first generation was made (None: none seen yet): the moment serving
    #: evidently applied the routing (``routed_users`` says why)
    routed_at: float | None = None
    #: user -> when their first generation in this canary completed (users ``Arm.users`` keeps):
    #: the time their episode's leaving ingest is counted from (``routed_users``)
    first_at: dict[str, float] = field(default_factory=dict)
    #: windows read whose first answer came before ``routed_at`` (``_read``): not counted, and
    #: their users' next answers open new windows
    before_routing: int = 0

    def arm_of(self, version: int) -> str | None:
        if version == self.canary_version:
            return "canary"
        if version == self.stable_version:
            return "stable"
        return None

    def __post_init__(self) -> None:
        self._seen = {"episodes": set(self.seen_episodes), "rewards": set(self.seen_rewards)}
        #: users in each state, kept as they change (the judge reads them after every record)
        self._states = {s: 0 for s in STATES}
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
        if g.route == "pinned":
            return  # evaluation traffic that named its version: no user's arm
        if g.created_at < self.started_at:
            self.windows.know(g.user_id)  # a user from before the canary: they may count
            return
        arm_name = self.arm_of(g.model_version)
        if arm_name is None or not self._first("episodes", g.generation_id):
            return
        arm = self.arms[arm_name]
        arm.requests += 1
        arm.errors += g.finish_reason == "abort"
        arm.count(g.user_id, U_REQUESTS)  # the user serving's hash placed: the guardrails' unit
        if arm_name == "canary" and (self.routed_at is None or g.created_at < self.routed_at):
            self.routed_at = g.created_at  # the earliest, whatever order the episodes arrive in
        if g.user_id in arm.users and g.completed_at < self.first_at.get(g.user_id, math.inf):
            self.first_at[g.user_id] = g.completed_at
        if g.finish_reason == "abort":
            arm.count(g.user_id, U_ERRORS)
        arm.latencies_ms.append(g.latency_ms)
        del arm.latencies_ms[:-LATENCY_SAMPLE]
        arm.tokens += len(g.completion_token_ids)
        arm.count(g.user_id, U_TOKENS, len(g.completion_token_ids))
        arm.count(g.user_id, U_LATENCY, g.latency_ms)
        if g.finish_reason != "abort":
            arm.text = arm.text.add(g.completion_text)
            arm.meaning = arm.meaning.add(g.prompt_text, g.completion_text)
        self._enter(arm_name, ep)
        signal, user = ep.signal, ep.rater_id or g.user_id
        if signal not in ("accept", "reject", "edit") or self.users.get(user) in (EXCLUDED, FLAGGED_LATE):
            return
        arm.rejects += signal == "reject"
        if signal == "reject":
            arm.count(g.user_id, U_REJECTS)

    def _enter(self, arm_name: str, ep: EpisodeEvent) -> None:
        """Open or extend the window of the answer's user (release/outcomes.py)."""
        g = ep.generation
        user, state = g.user_id, self.users.get(g.user_id)
        if state not in (None, PENDING):
            return  # read already (one outcome per user per canary), or left out
        # feedback belongs to the answer's user: another user's word on it is no one's outcome
        signal = ep.signal if ep.rater_id in (None, user) else "ignore"
        if self.windows.add(user, arm_name, g.completed_at, g.generation_id, signal):
            if state is None:
                self._set(user, PENDING)
        else:
            self._set(user, LATE)

    def add_reward(self, rw: RewardEvent) -> None:
        """Fold one reward record (decoded through the contract: release/streams.py) in."""
        gid = rw.generation_id
        if not self._first("rewards", gid):
            return
        abusive = any(f in ABUSE_FLAGS for f in rw.flags)
        if abusive:  # whatever the version or time: it says who the user is
            self._exclude(rw.rater_id or rw.user_id)
        arm_name = self.arm_of(rw.model_version) if rw.generated_at >= self.started_at else None
        if arm_name is None:
            return  # a generation from before the canary, or of neither arm: no guardrail count
        arm = self.arms[arm_name]
        arm.rewards += 1
        # only flags about the answer count against a version: abuse flags describe the user
        arm.flagged += any(f in HACKING_FLAGS for f in rw.flags)
        arm.count(rw.user_id, U_REWARDS)
        if any(f in HACKING_FLAGS for f in rw.flags):
            arm.count(rw.user_id, U_FLAGGED)

    def _exclude(self, user: str) -> None:
        state = self.users.get(user)
        if state == COUNTED:
            self._set(user, FLAGGED_LATE)
        elif state not in (EXCLUDED, FLAGGED_LATE):
            self._set(user, EXCLUDED)  # an open window of theirs is dropped when it is read

    def close(self, now: float) -> None:
        """Read the windows due by ``now`` and pair their outcomes (release/outcomes.py). ``now``: a
        time before which every record published has been folded (release/streams.py calls it when
        a read has caught up with the topics' ends as they were when it began)."""
        for read in self.windows.close(now, self._seen["rewards"].__contains__):
            self._read(read)

    def _read(self, read: Read) -> None:
        arm = self.arms[read.arm]
        if self.users.get(read.user) == EXCLUDED:  # flagged while their window was open
            arm.excluded += 1
            return
        if (self.routed_at is not None and read.first_at < self.routed_at
                and read.kind in (Kind.OUTCOME, Kind.SWITCHED)):
            # answered before serving evidently applied the routing, so on stable whatever their
            # hash: counted there, those the hash sent to the canary who came back within the
            # window (switched) were left out and the rest kept for not coming back. Not counted;
            # the user's next answer opens a window of their own arm. Every user active as the
            # canary started is in this gap (an object store's fetch makes it minutes): left out
            # for good, no canary of a small deployment reached a verdict
            self.before_routing += 1
            self._set(read.user, None)
            return
        if read.kind is not Kind.OUTCOME:
            self._set(read.user, read.kind.value)
            return
        self._set(read.user, COUNTED)
        arm.outcomes += 1
        arm.accepts += read.accepted
        self.pairing.add(read.arm, read.accepted)

    # -- what the judge reads ----------------------------------------------------------------
    def pairs(self) -> PairCount:
        return self.pairing.count

    def left_apart(self) -> dict[str, int]:
        """Users counted apart, by why (module docstring): the analysis and the console show them."""
        return {"new_users": self._states[NEW], "late_users": self._states[LATE],
                "unjudged_users": self._states[UNJUDGED], "switched_users": self._states[SWITCHED],
                "before_routing_users": self.before_routing}

    def routed_users(self) -> tuple[int, int]:
        """(canary, stable) users whose first generation in this canary was made at or after the
        canary's first, and settled: the sample-ratio check's units.

        Why at or after the canary's first: the tally starts before the routing is published and
        before serving has loaded the canary, and every user in that gap lands on stable whatever
        the share; counted, a few dozen of them (share 0.5) to a few hundred (0.1) held a correct
        canary. The canary's first generation is the moment serving evidently applied the routing,
        read from the records alone (no clock of another process, and the same whatever the users'
        feedback). Users from before it still count for the verdict and the guardrails.

        Why settled (completed at least the windows' ``settle_s`` before the clock they were last
        closed at: ingest's join window runs from an answer's completion): an episode leaves ingest when its signal comes (``ingest.emit_after_signal_s``)
        or when its join window closes, so rated answers reach the topic first. Counted as they
        arrived, the arm whose users rate more (a better canary's accepts) ran ahead of the other
        for a join window, and the check could hold a good canary on arrival order alone. By the
        settle time every user's first episode is in, whichever way it left.

        A user with no first time (a tally saved by older code) counts as before."""
        settled = self.windows.clock - self.windows.settle_s

        def routed(user: str) -> bool:
            at = self.first_at.get(user)
            return at is None or (self.routed_at is not None and self.routed_at <= at <= settled)

        canary, stable = (sum(1 for u, c in self.arms[a].users.items() if c[U_REQUESTS] and routed(u))
                          for a in ("canary", "stable"))
        return canary, stable

    def measurement(self, now: float) -> CanaryMeasurement:
        pending = {a: 0 for a in ARMS} | self.windows.waiting()  # open windows
        late = self._states[FLAGGED_LATE]
        full = any(len(a.users) >= MAX_GUARDRAIL_USERS for a in self.arms.values())
        return CanaryMeasurement(stable=self.arms["stable"].stats(pending["stable"]),
                                 canary=self.arms["canary"].stats(pending["canary"]), pairs=self.pairs(),
                                 elapsed_s=now - self.started_at, measurement_errors=self.errors,
                                 excluded_users=self._states[EXCLUDED] + late, flagged_after_counting=late,
                                 canary_share=None if full else self.share, routed_users=self.routed_users())

    # -- saved with the candidate ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "stable_version": self.stable_version, "canary_version": self.canary_version,
            "started_at": self.started_at, "alpha": self.alpha,
            "arms": {name: {"outcomes": a.outcomes, "accepts": a.accepts, "rejects": a.rejects,
                            "requests": a.requests, "errors": a.errors, "latencies_ms": a.latencies_ms,
                            "tokens": a.tokens, "flagged": a.flagged, "rewards": a.rewards, "excluded": a.excluded,
                            "text": a.text.to_dict(), "meaning": a.meaning.to_dict(), "users": a.users}
                     for name, a in self.arms.items()},
            "pairing": self.pairing.to_dict(), "users": self.users, "windows": self.windows.to_dict(),
            "seen_episodes": list(self.seen_episodes), "seen_rewards": list(self.seen_rewards),
            "offsets": {t: {str(p): n for p, n in parts.items()} for t, parts in self.offsets.items()},
            "errors": self.errors, "history": self.history,
            "share": self.share, "guardrail_look": self.guardrail_look,
            "routed_at": self.routed_at, "first_at": self.first_at, "before_routing": self.before_routing,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        # A tally saved by the previous fold (no "pairing": its pairs were rebuilt every tick from
        # a list sorted by generation time) keeps its offsets and guardrail counts; its accept-rate
        # test starts afresh from here, its outcomes not being pairs that can be resumed.
        folded = "pairing" in d
        # A tally saved before outcome windows (pairs in the order reward settled them) keeps its
        # pairs; its outcomes waiting for reward are dropped, and their users enter windows afresh
        # (read as soon as due: its canary started under the old rule).
        windows = Windows.from_dict(d["windows"]) if "windows" in d else Windows()
        arms = {name: Arm(a["outcomes"] if folded else 0, a["accepts"] if folded else 0, a.get("rejects", 0),
                          a["requests"], a["errors"], a["latencies_ms"], a["tokens"], a["flagged"], a["rewards"],
                          a.get("excluded", 0), TextProfile.from_dict(a["text"]) if "text" in a else TextProfile(),
                          # a tally saved before the meaning checks: they count from here on
                          MeaningProfile.from_dict(a["meaning"]) if "meaning" in a else MeaningProfile(),
                          # a user saved before tokens and latency were kept: in neither mean
                          {u: [*c, None, None][:7] for u, c in a.get("users", {}).items()})
                for name, a in d["arms"].items()}
        return cls(d["stable_version"], d["canary_version"], d["started_at"], d.get("alpha"), arms,
                   Pairing.from_dict(d["pairing"]) if folded else Pairing(), dict(d.get("users", {})),
                   deque(d["seen_episodes"]), deque(d["seen_rewards"]),
                   {t: {int(p): n for p, n in parts.items()} for t, parts in d["offsets"].items()},
                   d.get("errors", 0), d.get("history", []), share=d.get("share"),
                   guardrail_look=d.get("guardrail_look", 0), windows=windows,
                   routed_at=d.get("routed_at"), first_at=dict(d.get("first_at", {})),
                   before_routing=d.get("before_routing", 0))
