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
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from flywheel.settings import ReleaseSettings, RewardSettings
from release.budget import pass_level
from release.judge import CanaryMeasurement, CanaryPolicy, Outcome, judge_canary
from release.measure import Tally
from reward.guards import UserWindow, judge_user
from serving.routing import arm_of

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
                   signal: str, resolved_at: float) -> EpisodeEvent:
    """An episode as ingest writes it: the template with this generation's fields."""
    gen = EPISODE.generation.model_copy(update={
        "generation_id": gid, "group_id": gid, "model_version": version, "user_id": user, "created_at": created_at,
        "completed_at": created_at + latency_s, "latency_ms": 1000.0 * latency_s, "route": route})
    ignored = signal == "ignore"
    return EPISODE.model_copy(update={"generation": gen, "signal": signal,
                                      "feedback_ids": () if ignored else (f"f-{gid}",), "timed_out": ignored,
                                      "resolved_at": resolved_at})


def reward_record(gid: str, version: int, user: str, signal: str, flags: tuple[str, ...], generated_at: float,
                  labeled_at: float) -> RewardEvent:
    """A reward as reward's stage writes it."""
    return REWARD.model_copy(update={
        "generation_id": gid, "group_id": gid, "user_id": user, "model_version": version, "signal": signal,
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
    emit_after_s: float = 1.0
    window_s: float = 30.0
    #: False: every canary at alpha (what the budget across canaries replaced)
    budget: bool = True
    #: judge at most this often (the controller's ``release.tick_s``); 0: after every record that
    #: moved the counts, the strictest for a false-alarm rate
    tick_s: float = 0.0

    @property
    def horizon_s(self) -> float:
        return self.run_s or self.warmup_s + self.deadline_s


@dataclass(frozen=True)
class Request:
    t: float
    user: str
    accept_p: float
    latency_s: float
    #: seconds from the answer to the signal (None: no feedback)
    delay_s: float | None
    u: float  # the user's coin: accept when u < accept probability


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
        out.append(Request(t, user, p, rng.uniform(0.2, 1.0), delay, u))


Judge = Callable[[CanaryMeasurement, CanaryPolicy], Outcome]


def e_process(m: CanaryMeasurement, policy: CanaryPolicy) -> Outcome:
    """The controller's judge."""
    return judge_canary(m, policy).outcome


def naive_z(m: CanaryMeasurement, policy: CanaryPolicy) -> Outcome:
    """A deliberately invalid judge: a fixed-horizon one-sided z-test on the arms' accept rates,
    asked as often as the e-process is. The harness must see its false alarms."""
    s, c = m.stable, m.canary
    if min(s.outcomes, c.outcomes) < policy.min_events:
        return Outcome.RUNNING
    pooled = (s.accepts + c.accepts) / (s.outcomes + c.outcomes)
    se = math.sqrt(pooled * (1 - pooled) * (1 / s.outcomes + 1 / c.outcomes))
    if se > 0 and (c.accept_rate - s.accept_rate) / se >= NormalDist().inv_cdf(1 - policy.alpha):
        return Outcome.PASS
    return Outcome.RUNNING


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
        self.reqs = requests(sc, rng, run)
        self.rng = rng
        self.guards = Guards(RewardSettings())
        self.routes: list[tuple[float, int, int | None, str]] = [(-math.inf, 0, None, "")]  # from, stable, canary, salt
        self.live: Canary | None = None
        self.next_start = sc.warmup_s
        self.verdicts: list[Outcome] = []
        self.passes = 0
        self.signals: dict[int, tuple[int, str]] = {}  # request -> (version, signal), until its reward
        #: per canary judged: (pairs, the smaller arm's outcomes, users excluded) at its verdict
        self.sizes: list[tuple[int, int, int]] = []

    def routing(self, t: float) -> tuple[int, int | None, str]:
        return self.routes[bisect_right([r[0] for r in self.routes], t) - 1][1:]

    def outcomes(self) -> list[Outcome]:
        heap: list[tuple[float, int, str, int]] = []
        for i, r in enumerate(self.reqs):
            emit = r.t + r.latency_s + (r.delay_s + self.sc.emit_after_s if r.delay_s is not None else self.sc.window_s)
            heap.append((emit, i, "episode", i))
        heapq.heapify(heap)
        seq = len(heap)
        while heap:
            at, _, kind, i = heapq.heappop(heap)
            if at >= self.sc.horizon_s:
                break
            self._clock(at)
            rec = self._episode(i, at) if kind == "episode" else self._reward(i, at)
            if isinstance(rec, EpisodeEvent) and rec.signal != "ignore":
                seq += 1
                heapq.heappush(heap, (at + self.rng.uniform(0.2, 2.0), seq, "reward", i))
            if self.live is not None:
                self._fold(kind, rec, at)
        self._clock(self.sc.horizon_s)  # a canary still live when the run ends had no verdict: not counted
        return self.verdicts

    def _episode(self, i: int, at: float) -> EpisodeEvent:
        r = self.reqs[i]
        stable, canary, salt = self.routing(r.t)
        on_canary = canary is not None and arm_of(r.user, self.sc.canary_share, salt) == "canary"
        version = canary if on_canary else stable
        signal = "ignore"
        if r.delay_s is not None:
            signal = "accept" if r.u < r.accept_p + (self.sc.lift if on_canary else 0.0) else "reject"
        self.signals[i] = (version, signal)
        return episode_record(f"g{self.run}-{i}", version, r.user, r.t, r.latency_s,
                              "canary" if on_canary else "stable", signal, at)

    def _reward(self, i: int, at: float) -> RewardEvent:
        r = self.reqs[i]
        version, signal = self.signals.pop(i)
        return reward_record(f"g{self.run}-{i}", version, r.user, signal, self.guards.judge(r.user, signal), r.t, at)

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
        level = (pass_level(self.sc.alpha, ReleaseSettings().budget_canaries,
                            [v == Outcome.PASS for v in self.verdicts]) if self.sc.budget else self.sc.alpha)
        salt = f"bench/v{k}/{self.run}-{self.rng.getrandbits(32):08x}"
        policy = CanaryPolicy.of(ReleaseSettings(alpha=self.sc.alpha, min_events=self.sc.min_events,
                                                 deadline_s=self.sc.deadline_s))
        policy = replace(policy, pass_alpha=level)
        self.live = Canary(k, k, stable, salt, Tally(stable_version=stable, canary_version=k, started_at=at,
                                                     alpha=level), policy)
        self.routes.append((at, stable, k, salt))

    def _fold(self, kind: str, rec: EpisodeEvent | RewardEvent, at: float) -> None:
        live = self.live
        t = live.tally
        (t.add_episode if kind == "episode" else t.add_reward)(rec)
        marks = (t.pairing.count.pairs, t.arms["stable"].outcomes, t.arms["canary"].outcomes)
        if marks != live.marks and at >= live.judged_at + self.sc.tick_s:
            live.marks, live.judged_at = marks, at
            self._judge(at)

    def _judge(self, at: float) -> None:
        live = self.live
        m = live.tally.measurement(at)
        outcome = self.judge(m, live.policy)
        if outcome == Outcome.RUNNING and at < live.tally.started_at + self.sc.deadline_s:
            return
        if outcome == Outcome.RUNNING:
            outcome = Outcome.INCONCLUSIVE
        self.verdicts.append(outcome)
        self.sizes.append((m.pairs.pairs, min(m.stable.outcomes, m.canary.outcomes), m.excluded_users))
        self.passes += outcome == Outcome.PASS
        stable = live.version if outcome == Outcome.PASS else live.stable  # promoted, or rolled back
        self.routes.append((at, stable, None, ""))
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

    @property
    def rate(self) -> float:
        return self.passed / self.runs

    @property
    def se(self) -> float:
        """Standard error of ``rate`` (binomial), at least that of one run in ``runs``."""
        p = max(self.rate, 1 / self.runs)
        return math.sqrt(p * (1 - p) / self.runs)


def measure(sc: Scenario, runs: int, seed: int, judge: Judge = e_process) -> Rates:
    passed = first = 0
    sizes: list[tuple[int, int, int]] = []
    for run in range(runs):
        r = Run(sc, run, judge, random.Random(seed * 1_000_003 + run))
        verdicts = r.outcomes()
        passed += Outcome.PASS in verdicts
        first += bool(verdicts) and verdicts[0] == Outcome.PASS
        sizes += r.sizes
    n = max(1, len(sizes))
    return Rates(runs, passed, len(sizes), first, *(sum(s[i] for s in sizes) / n for i in range(3)))


def scenarios(demo: Any) -> list[Scenario]:
    """The null scenarios (identical versions); ``demo`` is local/demo.toml's release settings."""
    return [
        Scenario("i.i.d. users"),
        Scenario("an abusive user (10% of requests), reward's guards fresh", abuser=0.10, fixed_population=True),
        Scenario("late feedback (30% up to 300 s, rejects later)", late=0.3),
        Scenario("two tastes (0.55 / 0.10), 60 heavy-tailed users", users=60, cohorts=((0.6, 0.55), (0.4, 0.10)),
                 fixed_population=True, zipf=1.0),
        demo_scenario(demo),
    ]


def demo_scenario(demo: Any, **changes: Any) -> Scenario:
    """``flywheel demo``'s traffic and release settings: 200 users of two tastes, an abuser, 8
    requests/s for 210 s, the first canary a minute in, then canary after canary."""
    sc = Scenario("the demo's settings: 210 s of canaries", users=200, cohorts=((0.6, 0.35), (0.4, 0.20)),
                  fixed_population=True, abuser=0.10, warmup_s=60.0, canary_share=demo.canary_share,
                  min_events=demo.min_events, deadline_s=demo.deadline_s, alpha=demo.alpha, canaries=10,
                  run_s=210.0)
    return replace(sc, **changes)
