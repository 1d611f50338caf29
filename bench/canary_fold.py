"""Canaries of simulated users through the REAL measurement and judge: what bench/canary_stats.py's
validity and power rows are measured with (``flywheel bench --only canary``).

Nothing is served: requests are drawn (Poisson arrivals, one of the population's users each, a
share of them from an abusive user who accepts everything), and each becomes the records the
pipeline would write, built through flywheel/contracts.py (a record is a copy of a contract-built
template with its fields set: tests/unit/test_canary_fold.py holds it equal to the contract's own
encoding). The release controller's own code does the rest, record by record in arrival order:

- serving's salted hash (serving/routing.py ``arm_of``) puts each user in an arm, with a fresh salt
  per canary, as the release record carries it;
- reward's abuse guards (reward/guards.py ``judge_user``, counting as reward's stage counts) flag
  the users they would flag, on the reward records;
- release/measure.py's :class:`Tally` folds the episodes and rewards, and release/judge.py's
  ``judge_canary`` is asked after every record that moved its counts (the controller asks once a
  second: this looks more often, which can only raise a false-alarm rate), at the level the
  deployment's budget gives the canary (release/budget.py ``pass_level``).

A run is one canary, or (``canaries`` > 1, the demo) canary after canary as the controller runs
them: each ends on a verdict or at its deadline, rolled back or promoted, and the next starts
``gate_s`` later with its own salt and the budget's next level. With identical versions every
PASS is false; with ``lift`` the canary's users accept that much more often.

Each request is answered at its time: the routing then in force (a lagging replica's is older)
decides its arm, and the signal and when it reaches serving are decided then; ingest emits its
episode after the signal, or when its window closes (a signal sent later is late feedback, never
an episode's). The adversaries of :func:`adversary_scenarios` (bench/canary_stats.py table (e))
are knobs of :class:`Scenario`: rejects held or late, sock puppets, a requester rating under other
ids (through serving's owner check, serving/identity.py), a share change, lagging replicas, a
drifting accept rate.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from statistics import NormalDist
from typing import Any

from flywheel.contracts import (
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from flywheel.settings import IngestSettings, ReleaseSettings, RewardSettings, Settings
from release.budget import pass_level
from release.judge import CanaryMeasurement, CanaryPolicy, Outcome, Verdict, judge_tick
from release.measure import Tally
from release.outcomes import Windows
from reward.guards import UserWindow, judge_user
from serving.arms import split_salt
from serving.identity import Owner, owned_response_id, owner_of
from serving.routing import arm_of

#: Serving's routing secret (serving/arms.py), and serving's pseudonym
#: salt, which tags each answer with its user (serving/identity.py): made-up values, as the
#: adversaries know neither.
ROUTING_SECRET = "bench-routing-secret-0123456789"
USER_ID_SALT = "bench-pseudonym-salt-0123456789"

_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24)
_GEN = GenerationEvent(generation_id="g", group_id="g", model_name="flywheel", model_version=0, user_id="u",
                       endpoint="completions", created_at=0.0, completed_at=0.0, latency_ms=0.0, prompt_text="p",
                       prompt_token_ids=(1, 2), completion_text="c", completion_token_ids=(5, 6, 7, 8),
                       logprobs=(-1.0, -1.0, -1.0, -1.0), sampling=_SAMPLING, finish_reason="stop")
#: The contract's own records, decoded from their encodings as the controller decodes them;
#: records are copies (``model_copy``: a fold of millions of records would spend most of its
#: time validating again what these templates were validated for).
EPISODE = decode(EpisodeEvent, encode(EpisodeEvent(generation=_GEN, signal="accept", feedback_ids=("f",),
                                                   resolved_at=0.0)))
REWARD = decode(RewardEvent, encode(RewardEvent(generation_id="g", group_id="g", user_id="u", model_version=0,
                                                signal="accept", prompt_token_ids=(1, 2),
                                                completion_token_ids=(5, 6, 7, 8), logprobs=(-1.0, -1.0, -1.0, -1.0),
                                                sampling=_SAMPLING, reward=1.0, generated_at=0.0, labeled_at=0.0)))


def episode_record(gid: str, version: int, user: str, created_at: float, latency_s: float, route: str,
                   signal: str, resolved_at: float, rater: str | None = None) -> EpisodeEvent:
    """An episode as ingest writes it: the template with this generation's fields (``rater``: the
    user the feedback named, when not the generation's)."""
    gen = EPISODE.generation.model_copy(update={
        "generation_id": gid, "group_id": gid, "model_version": version, "user_id": user, "created_at": created_at,
        "completed_at": created_at + latency_s, "latency_ms": 1000.0 * latency_s, "route": route})
    ignored = signal == "ignore"
    return EPISODE.model_copy(update={"generation": gen, "signal": signal,
                                      "feedback_ids": () if ignored else (f"f-{gid}",), "timed_out": ignored,
                                      "rater_id": None if ignored else rater, "resolved_at": resolved_at})


def reward_record(gid: str, version: int, user: str, signal: str, flags: tuple[str, ...], generated_at: float,
                  labeled_at: float, rater: str | None = None) -> RewardEvent:
    """A reward as reward's stage writes it."""
    return REWARD.model_copy(update={
        "generation_id": gid, "group_id": gid, "user_id": user, "rater_id": rater, "model_version": version,
        "signal": signal,
        "reward": float(signal == "accept"), "flags": flags, "generated_at": generated_at,
        "labeled_at": labeled_at})


class Guards:
    """Reward's abuse guards over one window, counting as reward/stage.py does (``_count_user``,
    ``_keep``): each signal is counted against its user, judged, and kept unless capped."""

    def __init__(self, cfg: RewardSettings) -> None:
        self.cfg = cfg
        self.users: dict[str, list[int]] = {}  # n, kept, accept, reject
        self.total, self.signalling, self.kept = 0, 0, 0

    def judge(self, user: str, signal: str) -> tuple[str, ...]:
        c = self.users.setdefault(user, [0, 0, 0, 0])
        if c[0] == 0:
            self.signalling += 1
        c[0] += 1
        c[2 if signal == "accept" else 3] += 1
        self.total += 1
        verdict = judge_user(UserWindow(c[0], c[1], self.total, self.signalling,
                                        {"accept": c[2], "reject": c[3], "edit": 0, "ignore": 0}, self.kept), self.cfg)
        if "user_cap" not in verdict.flags:
            c[1] += 1
            self.kept += 1
        return verdict.flags


@dataclass(frozen=True)
class Scenario:
    """One kind of traffic a canary meets; the defaults are the demo's (local/simulate.py, demo.toml)."""

    name: str
    users: int = 300
    #: (share of users, their accept probability): the tastes
    cohorts: tuple[tuple[float, float], ...] = ((1.0, 0.30),)
    #: the same user ids and tastes in every run (one demo seed); else a fresh population per run
    fixed_population: bool = False
    #: heavy users: user i is picked with weight 1 / (i + 1) ** zipf (0: uniformly)
    zipf: float = 0.0
    rate: float = 8.0
    #: share of requests from one abusive user who accepts everything
    abuser: float = 0.0
    feedback_rate: float = 0.85
    max_delay_s: float = 3.0
    #: share of signals that come late, uniformly up to ``late_s`` (rejects twice as late)
    late: float = 0.0
    late_s: float = 300.0
    #: seconds of traffic (and reward's guard counts) before the first canary starts
    warmup_s: float = 0.0
    canary_share: float = 0.5
    min_events: int = 15
    deadline_s: float = 90.0
    alpha: float = 0.05
    canaries: int = 1
    run_s: float = 0.0  # a run of several canaries lasts this long (0: one canary's deadline)
    gate_s: float = 5.0
    #: the canary's users accept this much more often than stable's (0: identical versions)
    lift: float = 0.0
    #: ingest emits an episode this long after its signal, or when its window closes without one
    #: (a signal sent after the window closed is late feedback: ingest dead-letters it)
    emit_after_s: float = 1.0
    window_s: float = 30.0
    #: ingest's ``grace_s``, and the release settings that decide when a user's outcome is read
    grace_s: float = 1.0
    outcome_window_s: float = 0.0
    new_users: str = "exclude"
    #: the budget's block (``release.budget_canaries``)
    budget_canaries: int = ReleaseSettings().budget_canaries
    #: False: every canary at alpha (what the budget across canaries replaced)
    budget: bool = True
    #: judge at most this often (the controller's ``release.tick_s``); 0: after every record that
    #: moved the counts, the strictest for a false-alarm rate
    tick_s: float = 0.0
    # -- the adversaries and conditions of bench/canary_stats.py's table (e): 0 or None is none --
    #: rejects are held and sent together at every multiple of this many seconds (people who
    #: complain in batches, a client that flushes a queue); accepts go at once
    reject_every_s: float = 0.0
    #: every reject comes this many seconds after it would have (people take longer to complain)
    reject_late_s: float = 0.0
    #: sock puppets: new ids, first seen in the canary's first half, that accept only the canary's
    #: answers and stay silent otherwise, one request every ~8 s each
    puppets: int = 0
    #: whether a puppet knows which arm answered it (the answer names its version); else it guesses,
    #: a fair coin per answer, which is all a hidden version leaves it
    puppets_see_arm: bool = True
    #: one requester on the canary side (an id it picked because the answers named the canary),
    #: a request a second, whose answers are accepted under this many other users' ids
    raters: int = 0
    #: the canary share moves to this once the canary is ``share_at_s`` old
    share_to: float | None = None
    share_at_s: float = 45.0
    #: serving replicas a request lands on at random; ``lagging`` of them apply routings ``lag_s`` late
    replicas: int = 1
    lagging: int = 0
    lag_s: float = 0.0
    #: time of day: every user's accept probability moves by this much over the run, linearly,
    #: from -drift/2 at its start to +drift/2 at its end
    drift: float = 0.0

    def share(self, age_s: float) -> float:
        """The canary share ``age_s`` into a canary."""
        return self.canary_share if self.share_to is None or age_s < self.share_at_s else self.share_to

    @property
    def horizon_s(self) -> float:
        return self.run_s or self.warmup_s + self.deadline_s


class Who(StrEnum):
    """Who sent a request, which decides how its answer is judged (``Run._signal``)."""

    USER = "user"  # a user of the population: accepts by their taste
    PUPPET = "puppet"  # Scenario.puppets
    REQUESTER = "requester"  # Scenario.raters


@dataclass(frozen=True)
class Request:
    t: float
    user: str
    accept_p: float
    latency_s: float
    #: seconds from the answer to the signal (None: no feedback)
    delay_s: float | None
    u: float  # the user's coin: accept when u < accept probability
    who: Who = Who.USER
    replica: int = 0


def population(sc: Scenario, rng: random.Random, run: int) -> tuple[list[str], list[float]]:
    ids = rng if not sc.fixed_population else random.Random(0)
    names, tastes = [], []
    for i in range(sc.users):
        x, acc, p = ids.random(), 0.0, sc.cohorts[-1][1]
        for share, accept_p in sc.cohorts:
            acc += share
            if x < acc:
                p = accept_p
                break
        names.append(f"sim-{0 if sc.fixed_population else run}-{i}")
        tastes.append(p)
    return names, tastes


def requests(sc: Scenario, rng: random.Random, run: int) -> list[Request]:
    names, tastes = population(sc, rng, run)
    cum, acc = [], 0.0  # cumulative weights, made once: choices() would sum them for every request
    for i in range(sc.users):
        acc += 1 / (i + 1) ** sc.zipf
        cum.append(acc)
    who = range(sc.users)
    abuser = f"sim-{0 if sc.fixed_population else run}-abuser"
    # with late feedback, a minute of generations from before the canary whose signals come during it
    out, t = [], -60.0 if sc.late else 0.0
    while True:
        t += rng.expovariate(sc.rate)
        if t >= sc.horizon_s:
            return out
        abusive = rng.random() < sc.abuser
        i = 0 if abusive else rng.choices(who, cum_weights=cum)[0]
        user, p = (abuser, 1.0) if abusive else (names[i], tastes[i])
        fb = abusive or rng.random() < sc.feedback_rate
        delay = rng.uniform(0, sc.max_delay_s) if fb else None
        u = rng.random()
        if fb and not abusive and rng.random() < sc.late:
            delay = rng.uniform(0, sc.late_s) * (1.0 if u < p else 2.0) / 1.5
        replica = rng.randrange(sc.replicas) if sc.replicas > 1 else 0  # no draw otherwise: seeds stay
        out.append(Request(t, user, p, rng.uniform(0.2, 1.0), delay, u, Who.USER, replica))


def adversaries(sc: Scenario, rng: random.Random, run: int) -> list[Request]:
    """The puppets' and the requester's requests (Scenario), from the (first) canary's start."""
    out = []
    start, end = sc.warmup_s, sc.horizon_s
    for j in range(sc.puppets):
        t = start + rng.uniform(0, sc.deadline_s / 2)
        while t < end:
            out.append(Request(t, f"puppet-{run}-{j}", 0.0, rng.uniform(0.2, 1.0), rng.uniform(0, sc.max_delay_s),
                               rng.random(), Who.PUPPET))
            t += rng.expovariate(1 / 8)
    t = start
    while sc.raters and (t := t + rng.expovariate(1.0)) < end:
        out.append(Request(t, "", 0.0, rng.uniform(0.2, 1.0), rng.uniform(0, sc.max_delay_s), rng.random(),
                           Who.REQUESTER))
    return out


def signal_time(answered_at: float, delay_s: float, signal: str, sc: Scenario) -> float:
    """When a signal sent ``delay_s`` after its answer reaches serving: a reject ``reject_late_s``
    later, and with ``reject_every_s`` held to the next multiple of it."""
    at = answered_at + delay_s
    if signal != "reject":
        return at
    at += sc.reject_late_s
    return math.ceil(at / sc.reject_every_s) * sc.reject_every_s if sc.reject_every_s else at


#: A judge: the measurement, the policy and the guardrail looks taken before -> the verdict and
#: the looks taken after it (release/judge.py ``judge_tick``).
Judge = Callable[[CanaryMeasurement, CanaryPolicy, int], tuple[Verdict, int]]


def e_process(m: CanaryMeasurement, policy: CanaryPolicy, looks: int) -> tuple[Verdict, int]:
    """The controller's judge, as its tick asks it."""
    return judge_tick(m, policy, looks)


class Call(StrEnum):
    """What ended a canary, as the bench's table counts it."""

    PASS = "pass"
    FAIL = "fail"  # the accept-rate test: canary worse
    GUARDRAIL = "guardrail"  # a guardrail breached
    HELD = "held"  # stopped for a person before its deadline (not PASS or FAIL)
    DEADLINE = "deadline"  # no verdict by the deadline


def call_of(v: Verdict, at_deadline: bool) -> Call:
    """The kind of a final verdict; ``at_deadline``: it was asked at the canary's deadline."""
    if v.outcome == Outcome.PASS:
        return Call.PASS
    if v.outcome == Outcome.FAIL:
        return Call.GUARDRAIL if any(r.startswith("guardrail") for r in v.reasons) else Call.FAIL
    return Call.DEADLINE if at_deadline and v.outcome in (Outcome.RUNNING, Outcome.INCONCLUSIVE) else Call.HELD


def naive_z(m: CanaryMeasurement, policy: CanaryPolicy, looks: int) -> tuple[Verdict, int]:
    """A deliberately invalid judge: a fixed-horizon one-sided z-test on the arms' accept rates,
    asked as often as the e-process is. The harness must see its false alarms."""
    s, c = m.stable, m.canary
    if min(s.outcomes, c.outcomes) < policy.min_events:
        return Verdict(Outcome.RUNNING), looks
    pooled = (s.accepts + c.accepts) / (s.outcomes + c.outcomes)
    se = math.sqrt(pooled * (1 - pooled) * (1 / s.outcomes + 1 / c.outcomes))
    if se > 0 and (c.accept_rate - s.accept_rate) / se >= NormalDist().inv_cdf(1 - policy.alpha):
        return Verdict(Outcome.PASS), looks
    return Verdict(Outcome.RUNNING), looks


@dataclass
class Canary:
    k: int
    version: int
    stable: int
    salt: str
    tally: Tally
    policy: CanaryPolicy
    marks: tuple[int, ...] = ()
    judged_at: float = -math.inf


class Run:
    """One run: the requests' records in arrival order, through the live canary's tally."""

    def __init__(self, sc: Scenario, run: int, judge: Judge, rng: random.Random) -> None:
        self.sc, self.run, self.judge = sc, run, judge
        self.reqs = sorted(requests(sc, rng, run) + adversaries(sc, rng, run), key=lambda r: r.t)
        self.rng = rng
        self.guards = Guards(RewardSettings())
        #: from, stable, canary, salt, the canary's start
        self.routes: list[tuple[float, int, int | None, str, float]] = [(-math.inf, 0, None, "", 0.0)]
        self.live: Canary | None = None
        self.next_start = sc.warmup_s
        self.verdicts: list[Outcome] = []
        self.calls: list[Call] = []
        #: the level each canary's PASS was tested at, and its FAIL
        self.levels: list[tuple[float, float]] = []
        self.passes = 0
        #: request -> (version, route, user, signal, rater), from its answer until its reward
        self.served: dict[int, tuple[int, str, str, str, str | None]] = {}
        self.requester: tuple[str, str] = ("", "")  # (salt, the id it picked for it)
        self.raters_used = 0
        #: users of the episodes emitted so far, the most recent last: who a new canary knows
        self.emitted: dict[str, None] = {}
        #: per canary judged: (pairs, the smaller arm's outcomes, users excluded) at its verdict
        self.sizes: list[tuple[int, int, int]] = []

    def routing(self, t: float) -> tuple[int, int | None, str, float]:
        """(stable, canary, salt, share) as serving routes at ``t``."""
        _, stable, canary, salt, start = self.routes[bisect_right([r[0] for r in self.routes], t) - 1]
        return stable, canary, salt, self.sc.share(t - start)

    def outcomes(self) -> list[Outcome]:
        # each request is answered at its time (its arm and signal decided then, from the routing
        # in force), and its episode is pushed for when ingest emits it
        heap: list[tuple[float, int, str, int]] = [(r.t, i, "answer", i) for i, r in enumerate(self.reqs)]
        heapq.heapify(heap)
        seq = len(heap)
        while heap:
            at, _, kind, i = heapq.heappop(heap)
            if at >= self.sc.horizon_s:
                break
            self._clock(at)
            if kind == "answer":
                seq += 1
                heapq.heappush(heap, (self._answer(i), seq, "episode", i))
                continue
            rec = self._episode(i, at) if kind == "episode" else self._reward(i, at)
            if kind == "episode":
                self.emitted.pop(rec.generation.user_id, None)
                self.emitted[rec.generation.user_id] = None
            if isinstance(rec, EpisodeEvent) and rec.signal != "ignore":
                seq += 1
                heapq.heappush(heap, (at + self.rng.uniform(0.2, 2.0), seq, "reward", i))
            if self.live is not None:
                self._fold(kind, rec, at)
        self._clock(self.sc.horizon_s)  # a canary still live when the run ends had no verdict: not counted
        return self.verdicts

    def _answer(self, i: int) -> float:
        """Serve request ``i``: its version and signal; returns when ingest emits its episode."""
        r, sc = self.reqs[i], self.sc
        lagging = r.replica < sc.lagging
        stable, canary, salt, share = self.routing(r.t - sc.lag_s if lagging else r.t)
        user = self._requester_id(salt, share) if r.who == Who.REQUESTER else r.user
        on_canary = canary is not None and self._arm(user, share, salt) == "canary"
        signal, rater = self._signal(r, on_canary)
        self.served[i] = (canary if on_canary else stable, "canary" if on_canary else "stable", user, signal, rater)
        answered = r.t + r.latency_s
        sent = answered + sc.window_s if signal == "ignore" else signal_time(answered, r.delay_s, signal, sc)
        if sent >= answered + sc.window_s:  # no signal, or one sent after ingest's window closed
            self.served[i] = (*self.served[i][:3], "ignore", None)
            return answered + sc.window_s
        return sent + sc.emit_after_s

    def _signal(self, r: Request, on_canary: bool) -> tuple[str, str | None]:
        """(signal, rater): what came back for an answer, and the user it named if not its own."""
        if r.who == Who.PUPPET:
            believed = on_canary if self.sc.puppets_see_arm else r.u < 0.5
            return ("accept" if believed else "ignore"), None
        if r.who == Who.REQUESTER:
            if not on_canary or self.raters_used >= self.sc.raters:
                return "ignore", None
            self.raters_used += 1
            rater = f"rater-{self.run}-{self.raters_used}"
            return ("accept", rater) if self._feedback_counts(r, rater) else ("ignore", None)
        if r.delay_s is None:
            return "ignore", None
        p = r.accept_p + self.sc.drift * (r.t / self.sc.horizon_s - 0.5) + (self.sc.lift if on_canary else 0.0)
        return ("accept" if r.u < p else "reject"), None

    def _feedback_counts(self, r: Request, rater: str) -> bool:
        """Whether feedback naming ``rater`` on the requester's answer becomes its signal: serving
        tags every answer with its user (serving/identity.py) and takes feedback naming another
        user as no one's (refused, or recorded for audit and never counted by ingest)."""
        gid = owned_response_id(USER_ID_SALT, f"cmpl-{int(r.t * 1e6) & (2**128 - 1):032x}", self.requester[1])
        return owner_of(USER_ID_SALT, gid, rater) is not Owner.OTHER

    def _arm(self, user: str, share: float, salt: str) -> str:
        """The arm serving puts ``user`` in: the split salted under the routing secret."""
        return arm_of(user, share, split_salt(ROUTING_SECRET, salt)) if salt else "stable"

    def _requester_id(self, salt: str, share: float) -> str:
        """The requester's id for this canary: it tries ids until the answers name the canary."""
        if self.requester[0] != salt or not salt:
            n = 0
            while salt and self._arm(f"req-{self.run}-{n}", share, salt) != "canary":
                n += 1
            self.requester = (salt, f"req-{self.run}-{n}")
        return self.requester[1]

    def _episode(self, i: int, at: float) -> EpisodeEvent:
        r = self.reqs[i]
        version, route, user, signal, rater = self.served[i]
        if signal == "ignore":
            del self.served[i]
        return episode_record(f"g{self.run}-{i}", version, user, r.t, r.latency_s, route, signal, at, rater)

    def _reward(self, i: int, at: float) -> RewardEvent:
        r = self.reqs[i]
        version, _, user, signal, rater = self.served.pop(i)
        flags = self.guards.judge(rater or user, signal)
        return reward_record(f"g{self.run}-{i}", version, user, signal, flags, r.t, at, rater)

    def _clock(self, now: float) -> None:
        """Deadlines and starts due by ``now``, in order."""
        while True:
            if self.live is not None and now >= self.live.tally.started_at + self.sc.deadline_s:
                self._judge(self.live.tally.started_at + self.sc.deadline_s)
            elif self.live is None and now >= self.next_start and len(self.verdicts) < self.sc.canaries:
                self._start(self.next_start)
            else:
                return

    def _start(self, at: float) -> None:
        k = len(self.verdicts) + 1
        stable = self.routes[-1][1]
        level = (pass_level(self.sc.alpha, self.sc.budget_canaries,
                            [v == Outcome.PASS for v in self.verdicts]) if self.sc.budget else self.sc.alpha)
        salt = f"bench/v{k}/{self.run}-{self.rng.getrandbits(32):08x}"
        policy = CanaryPolicy.of(ReleaseSettings(alpha=self.sc.alpha, min_events=self.sc.min_events,
                                                 deadline_s=self.sc.deadline_s))
        policy = replace(policy, pass_alpha=level)
        self.live = Canary(k, k, stable, salt, self._tally(stable, k, at, level), policy)
        self.routes.append((at, stable, k, salt, at))

    def _tally(self, stable: int, k: int, at: float, level: float) -> Tally:
        """The canary's tally, as the controller makes it (its outcome windows from the settings)."""
        sc = self.sc
        settings = Settings(ingest=IngestSettings(window_s=sc.window_s, grace_s=sc.grace_s),
                            release=ReleaseSettings(outcome_window_s=sc.outcome_window_s, new_users=sc.new_users))
        # the share asked for as the canary started: what the sample-ratio check holds the arms to
        tally = Tally(stable_version=stable, canary_version=k, started_at=at, alpha=level, share=sc.canary_share)
        tally.windows = Windows.of(settings)
        if not tally.windows.count_new_users:
            # the controller reads the users of the episodes before the canary's start offsets
            # (release/streams.py known_users, a lookback longer than any run here)
            for user in self.emitted:
                tally.windows.know(user)
        return tally

    def _fold(self, kind: str, rec: EpisodeEvent | RewardEvent, at: float) -> None:
        live = self.live
        t = live.tally
        (t.add_episode if kind == "episode" else t.add_reward)(rec)
        # every record before ``at`` is folded: the windows due by then are read, as the controller
        # reads them once its read has caught up with the topics
        t.close(at)
        marks = (t.pairing.count.pairs, t.arms["stable"].outcomes, t.arms["canary"].outcomes)
        if marks != live.marks and at >= live.judged_at + self.sc.tick_s:
            live.marks, live.judged_at = marks, at
            self._judge(at)

    def _judge(self, at: float) -> None:
        live = self.live
        live.tally.close(at)
        m = live.tally.measurement(at)
        verdict, live.tally.guardrail_look = self.judge(m, live.policy, live.tally.guardrail_look)
        at_deadline = at >= live.tally.started_at + self.sc.deadline_s
        if verdict.outcome == Outcome.RUNNING and not at_deadline:
            return
        outcome = Outcome.INCONCLUSIVE if verdict.outcome == Outcome.RUNNING else verdict.outcome
        self.verdicts.append(outcome)
        self.calls.append(call_of(verdict, at_deadline))
        self.levels.append((live.policy.pass_alpha or live.policy.alpha, live.policy.alpha))
        self.sizes.append((m.pairs.pairs, min(m.stable.outcomes, m.canary.outcomes), m.excluded_users))
        self.passes += outcome == Outcome.PASS
        stable = live.version if outcome == Outcome.PASS else live.stable  # promoted, or rolled back
        self.routes.append((at, stable, None, "", at))
        self.live = None
        self.next_start = at + self.sc.gate_s


@dataclass(frozen=True)
class Rates:
    runs: int
    passed: int  # runs with at least one PASS
    canaries: int
    first_canary_passed: int
    #: means over the canaries judged, at their verdicts
    pairs: float = 0.0
    outcomes: float = 0.0  # the smaller arm's
    excluded_users: float = 0.0
    #: runs with at least one FAIL of the accept-rate test, of a guardrail, and one held
    failed: int = 0
    guardrail: int = 0
    held: int = 0
    #: the levels the first canary of a run is tested at, PASS and FAIL (the same in every run)
    pass_level: float = 0.0
    fail_level: float = 0.0

    @property
    def rate(self) -> float:
        return self.passed / self.runs

    @property
    def se(self) -> float:
        """Standard error of ``rate`` (binomial), at least that of one run in ``runs``."""
        return share_se(self.rate, self.runs)


def share_se(rate: float, runs: int) -> float:
    """The binomial standard error of a share of ``runs``, at least that of one run in them."""
    p = max(rate, 1 / runs)
    return math.sqrt(p * (1 - p) / runs)


def measure(sc: Scenario, runs: int, seed: int, judge: Judge = e_process) -> Rates:
    passed = first = failed = guardrail = held = 0
    sizes: list[tuple[int, int, int]] = []
    levels: list[tuple[float, float]] = []
    for run in range(runs):
        r = Run(sc, run, judge, random.Random(seed * 1_000_003 + run))
        verdicts = r.outcomes()
        passed += Outcome.PASS in verdicts
        first += bool(verdicts) and verdicts[0] == Outcome.PASS
        failed += Call.FAIL in r.calls
        guardrail += Call.GUARDRAIL in r.calls
        held += Call.HELD in r.calls
        sizes += r.sizes
        levels += r.levels[:1]
    n = max(1, len(sizes))
    return Rates(runs, passed, len(sizes), first, *(sum(s[i] for s in sizes) / n for i in range(3)),
                 failed, guardrail, held, *(levels[0] if levels else (0.0, 0.0)))


def scenarios(demo: Settings) -> list[Scenario]:
    """The null scenarios (identical versions); ``demo``: local/demo.toml's settings."""
    # no traffic before these canaries is simulated: their users are the deployment's established
    # ones, counted as such (new_users "count"); table (e) measures the rule for new users
    return [
        Scenario("i.i.d. users", new_users="count"),
        Scenario("an abusive user (10% of requests), reward's guards fresh", abuser=0.10, fixed_population=True,
                 new_users="count"),
        Scenario("late feedback (30% up to 300 s, rejects later)", late=0.3, new_users="count"),
        Scenario("two tastes (0.55 / 0.10), 60 heavy-tailed users", users=60, cohorts=((0.6, 0.55), (0.4, 0.10)),
                 fixed_population=True, zipf=1.0, new_users="count"),
        demo_scenario(demo),
    ]


def demo_scenario(demo: Settings, **changes: Any) -> Scenario:
    """``flywheel demo``'s traffic and its release and ingest settings: 200 users of two tastes, an
    abuser, 8 requests/s for 210 s, the first canary a minute in, then canary after canary."""
    rel, ing = demo.release, demo.ingest
    sc = Scenario("the demo's settings: 210 s of canaries", users=200, cohorts=((0.6, 0.35), (0.4, 0.20)),
                  fixed_population=True, abuser=0.10, warmup_s=60.0, canary_share=rel.canary_share,
                  min_events=rel.min_events, deadline_s=rel.deadline_s, alpha=rel.alpha, canaries=10,
                  run_s=210.0, window_s=ing.window_s, grace_s=ing.grace_s,
                  emit_after_s=ing.emit_after_signal_s or ing.window_s, outcome_window_s=rel.outcome_window_s,
                  new_users=rel.new_users, budget_canaries=rel.budget_canaries)
    return replace(sc, **changes)


#: The traffic the adversaries of table (e) meet: the i.i.d. users, a minute of it before the canary
#: starts (users seen before the canary, as on a running deployment), one canary of 150 s. Ingest's
#: window is 90 s, so that rejects a minute late still count, and a user's outcome is read 91 s
#: after their first answer (release/outcomes.py).
ADVERSARY_BASE = Scenario("base", warmup_s=60.0, window_s=90.0, deadline_s=150.0)


def adversary_scenarios() -> list[Scenario]:
    """Table (e): who and what could steer a verdict between identical versions (issue 45)."""
    b = ADVERSARY_BASE
    return [
        replace(b, name="rejects held, sent in bursts every 30 s, share 0.5", reject_every_s=30.0),
        replace(b, name="rejects held, sent in bursts every 30 s, share 0.1", reject_every_s=30.0,
                canary_share=0.1, users=1000, rate=20.0),
        replace(b, name="rejects 5 s late (accepts at once)", reject_late_s=5.0),
        replace(b, name="rejects 20 s late (accepts at once)", reject_late_s=20.0),
        replace(b, name="rejects 60 s late (accepts at once)", reject_late_s=60.0),
        replace(b, name="30 sock puppets that see their arm", puppets=30),
        replace(b, name="30 sock puppets that guess their arm (versions hidden)", puppets=30, puppets_see_arm=False),
        replace(b, name="one requester, answers accepted under 60 rater ids", raters=60),
        replace(b, name="heavy users: 60 users of two tastes (0.55 / 0.10), Zipf 1", users=60,
                cohorts=((0.6, 0.55), (0.4, 0.10)), zipf=1.0),
        replace(b, name="heavy users: 30 users of two tastes (0.55 / 0.10), Zipf 1.5", users=30,
                cohorts=((0.6, 0.55), (0.4, 0.10)), zipf=1.5),
        replace(b, name="share 0.1, raised to 0.5 half way", canary_share=0.1, share_to=0.5),
        replace(b, name="routing applied late: 2 of 4 replicas 20 s behind", replicas=4, lagging=2, lag_s=20.0),
        replace(b, name="time of day: accept rate 0.15 -> 0.45 over the run, share 0.1", drift=0.30,
                canary_share=0.1, users=1000, rate=20.0),
    ]
