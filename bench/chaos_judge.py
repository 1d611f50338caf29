"""The whole-loop fault run's invariants, judged from what the run left (pure; bench/chaos.py
measures, this judges; tests/unit/test_chaos_judge.py holds one table per rule).

Each rule takes plain facts read from the topics, the archives' sources, the trainer's ledgers and
the release store, and returns an :class:`Invariant`: its name, whether it held, how many cases
broke it and up to :data:`SHOWN` of them as evidence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Broken cases an invariant quotes as evidence (the count is always whole).
SHOWN = 10
#: Seconds of slack around a serving restart window: a request sent a moment before the kill
#: landed can fail on the dying server's socket.
RESTART_SLACK_S = 1.0


@dataclass(frozen=True)
class Invariant:
    name: str
    held: bool
    broken: int = 0
    detail: str = ""
    evidence: list[Any] = field(default_factory=list)


def _inv(name: str, broken: list[Any], detail: str) -> Invariant:
    return Invariant(name, not broken, len(broken), detail, broken[:SHOWN])


def judged_accounted(judged: Iterable[str], rewards: Mapping[str, set[bytes]],
                     dead: Mapping[str, set[str]]) -> tuple[Invariant, Invariant, dict[str, Any]]:
    """Every judged generation became exactly one distinct reward, or a dead letter with its reason.

    ``rewards``: generation id -> the distinct reward records (bytes) on the rewards topic; the
    same record twice is one (delivery is at least once, readers drop repeats by key).
    ``dead``: generation id -> reasons of dead letters about it (its generation, feedback or
    episode). Returns (lost, double-counted, counts)."""
    judged = sorted(set(judged))
    lost = [g for g in judged if not rewards.get(g) and not dead.get(g)]
    double = [{"generation_id": g, "distinct_rewards": len(rewards[g])} for g in judged if len(rewards.get(g, ())) > 1]
    reasons = Counter(r for g in judged if not rewards.get(g) for r in dead.get(g, ()))
    counts = {"judged": len(judged), "rewarded": sum(1 for g in judged if rewards.get(g)),
              "dead_lettered": sum(1 for g in judged if not rewards.get(g) and dead.get(g)),
              "dead_letter_reasons": dict(reasons), "lost": len(lost), "double_counted": len(double)}
    return (_inv("every judged generation became one reward or a dead letter", lost,
                 f"{len(lost)} of {len(judged)} judged generations lost"),
            _inv("no generation rewarded twice", double, f"{len(double)} with more than one distinct reward"),
            counts)


def double_trained(ledgers: Mapping[int, list[str]]) -> Invariant:
    """No generation is in the trained list of two versions, nor twice in one."""
    where: dict[str, list[int]] = {}
    for version, trained in sorted(ledgers.items()):
        for gid in trained:
            where.setdefault(gid, []).append(version)
    twice = [{"generation_id": g, "versions": vs} for g, vs in sorted(where.items()) if len(vs) > 1]
    total = sum(len(t) for t in ledgers.values())
    return _inv("no version trained on a sample twice", twice,
                f"{len(twice)} of {len(where)} trained samples twice ({total} ledger entries, {len(ledgers)} versions)")


@dataclass(frozen=True)
class VersionCheck:
    """What was found about one version users were served."""

    version: int
    first_served_at: float
    #: sha256 of its manifest in the checkpoint store (None: the store has no such version)
    store_manifest: str | None
    #: the manifest hash its checkpoint record announced, and the release store's candidate holds
    announced_manifest: str | None
    candidate_manifest: str | None
    #: the release controller moved it to canary (it passed the gate)
    gated: bool
    #: the first routing on the releases topic that named it (epoch seconds; None: never routed)
    first_routed_at: float | None
    #: its weights rebuilt from the chain matched every hash (None: not checked; text: the failure)
    chain_error: str | None = None


def unverified(checks: Iterable[VersionCheck], clock_slack_s: float = 1.0) -> Invariant:
    """Every version users were served (above 0: version 0 is the model directory) was verified:
    its manifest in the store is the one announced and gated, the gate passed, a routing named it
    before it served, and its weights rebuilt from the store match every hash."""
    bad = []
    for c in sorted(checks, key=lambda c: c.version):
        if c.version == 0:
            continue
        why = []
        if c.store_manifest is None:
            why.append("not in the checkpoint store")
        elif c.store_manifest != c.announced_manifest or c.store_manifest != c.candidate_manifest:
            why.append(f"manifest {c.store_manifest} != announced {c.announced_manifest} / "
                       f"candidate {c.candidate_manifest}")
        if not c.gated:
            why.append("never passed the gate to canary")
        if c.first_routed_at is None:
            why.append("no routing named it")
        elif c.first_routed_at > c.first_served_at + clock_slack_s:
            why.append(f"served {c.first_routed_at - c.first_served_at:.1f} s before a routing named it")
        if c.chain_error:
            why.append(f"weights: {c.chain_error}")
        if why:
            bad.append({"version": c.version, "why": why})
    return _inv("every version served was verified", bad, f"{len(bad)} unverified served versions")


ROUTING_FIELDS = ("revision", "stable_version", "canary_version", "canary_share")


def routing_agrees(store: Mapping[str, Any] | None, topic: Mapping[str, Any] | None) -> Invariant:
    """The release store's newest revision is published and is the last routing on the topic."""
    if store is None and topic is None:
        return _inv("the release store and the last published routing agree", [], "no routing yet")
    bad = []
    if store is None or topic is None:
        bad.append({"store": store, "topic": topic})
    else:
        if not store.get("published"):
            bad.append({"field": "published", "store": False})
        for f in ROUTING_FIELDS:
            if store.get(f) != topic.get(f):
                bad.append({"field": f, "store": store.get(f), "topic": topic.get(f)})
    return _inv("the release store and the last published routing agree", bad,
                f"store revision {store and store.get('revision')}, topic revision {topic and topic.get('revision')}")


def unanswered(rows: Iterable[Mapping[str, Any]], windows: list[tuple[float, float]],
               refusals: tuple[int, ...] = (429,)) -> Invariant:
    """Users were answered, apart from serving's own restarts: a request that failed (no answer,
    or an error status) counts unless its span [sent, sent + latency] meets a restart window
    (kill to ready again, with :data:`RESTART_SLACK_S`). ``refusals`` are answers by design
    (the abuser's rate limit)."""
    failed = [r for r in rows if r["status"] != 200 and r["status"] not in refusals]
    outside = []
    for r in failed:
        start, end = r["at"], r["at"] + r["latency_s"]
        if not any(start <= w_end + RESTART_SLACK_S and end >= w_start - RESTART_SLACK_S for w_start, w_end in windows):
            outside.append({"at": r["at"], "status": r["status"], "latency_s": round(r["latency_s"], 3)})
    inside = len(failed) - len(outside)
    return _inv("users were answered outside serving's restarts", outside,
                f"{len(outside)} failed outside restarts, {inside} inside {len(windows)} restart windows")


def orphans(left: Iterable[Mapping[str, Any]]) -> Invariant:
    """No process outlived the role that started it: ``left`` lists each process of a killed
    instance (its vLLM engines above all) still alive when checked, read from the process table."""
    left = list(left)
    return _inv("no process outlives the role that started it", left, f"{len(left)} processes left running")


def malformed_dead_lettered(injected: Iterable[tuple[str, str]], dead_keys: set[tuple[str, str]]) -> Invariant:
    """Every malformed record written to an input topic was dead-lettered (by the key it was sent with)."""
    lost = [{"topic": t, "key": k} for t, k in injected if (t, k) not in dead_keys]
    injected = list(injected)
    return _inv("every malformed record was dead-lettered", lost, f"{len(lost)} of {len(injected)} not dead-lettered")


def still_learns(accept: Mapping[int, Mapping[str, Any]], last_promoted: int | None) -> Invariant:
    """The last promoted version's accept rate is at least version 0's (from the users' judgements).
    A run that promoted nothing did not show the loop learning, and breaks it."""
    v0 = accept.get(0, {}).get("accept_rate")
    if last_promoted is None:
        return _inv("the loop still learns", [{"why": "no version was promoted"}], "nothing promoted")
    last = accept.get(last_promoted, {}).get("accept_rate")
    bad = [] if v0 is not None and last is not None and last >= v0 else [
        {"v0": v0, "version": last_promoted, "accept_rate": last}]
    return _inv("the loop still learns", bad, f"v{last_promoted} {_f(last)} vs v0 {_f(v0)}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
