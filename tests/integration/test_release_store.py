"""The release store (release/store.py) and the actions on it (release/actions.py), on both
databases it supports: an SQLite file and a PostgreSQL server.

PostgreSQL: ``TEST_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``); each
test gets a fresh schema of its own (``search_path`` in the URL), dropped afterwards. Without a
server there the PostgreSQL cases are skipped, saying why.

The crash tests run a transition in a child process that stops inside the transaction, after
the candidate's state is updated but before the rest is written, and SIGKILL it there: the
store must come back with all of the transition or none of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from release import actions
from release.actions import ActionRefused
from release.states import State, TransitionRefused
from release.store import ReleaseStore, Routing

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
#: The controller that records candidates in these tests, as the audit log names it.
CONTROLLER = "controller:test"


@pytest.fixture
def url(release_db_url):
    """Every test here runs on each database the store supports (tests/conftest.py)."""
    return release_db_url


@pytest.fixture
def store(url):
    s = ReleaseStore(url)
    yield s
    s.close()


def event(version: int, **extra) -> dict:
    return {"version": version, "parent": version - 1, "uri": f"file:///ckpt/v{version}",
            "manifest_sha256": f"{version:064x}", "step": 10 * version, "metrics": {"loss": 1.0 / version},
            **extra}


def to_state(store: ReleaseStore, version: int, state: State, share: float = 0.1) -> None:
    """Add ``version`` and walk it the usual way to ``state`` (canary routing on entering canary)."""
    store.add_candidate(event(version), CONTROLLER)
    path = {State.GATING: [State.GATING], State.CANARY: [State.GATING, State.CANARY],
            State.AWAITING_APPROVAL: [State.GATING, State.CANARY, State.AWAITING_APPROVAL],
            State.HELD: [State.GATING, State.CANARY, State.HELD]}[state]
    for target in path:
        routing = Routing(store.stable_version(), version, share) if target == State.CANARY else None
        store.transition(version, target, "controller", f"to {target.value}", routing=routing)


# -- candidates and transitions ------------------------------------------------------------------

def test_add_candidate_is_idempotent(store):
    assert store.add_candidate(event(3), CONTROLLER) is True
    assert store.add_candidate(event(3, step=999), CONTROLLER) is False  # a repeat from the topic
    cand = store.get(3)
    assert cand.state == State.CANDIDATE and cand.parent == 2 and cand.uri == "file:///ckpt/v3"
    assert cand.checkpoint["step"] == 30  # the first record stays
    assert [(a.version, a.from_state, a.to_state) for a in store.audit()] == [(3, None, "candidate")]
    assert store.audit()[0].evidence == {"metrics": {"loss": 1 / 3}}
    assert [c.version for c in store.candidates()] == [3]
    assert store.get(4) is None


def test_transitions_are_idempotent_and_audited(store):
    store.add_candidate(event(1), CONTROLLER)
    evidence = {"gate": {"kl": 0.2}, "prompts": 32}
    assert store.transition(1, State.GATING, "controller", "gate started") is True
    assert store.transition(1, State.GATING, "controller", "gate started again") is False  # no-op
    assert store.transition(1, State.REJECTED, "alice", "KL too high", evidence) is True
    with pytest.raises(TransitionRefused, match="version 1 is already rejected: it cannot become gating"):
        store.transition(1, State.GATING, "controller", "again")
    with pytest.raises(KeyError):
        store.transition(99, State.GATING, "controller", "unknown")
    entries = store.audit(1)  # newest first
    assert [(a.from_state, a.to_state, a.actor, a.reason) for a in entries] == [
        ("gating", "rejected", "alice", "KL too high"),
        ("candidate", "gating", "controller", "gate started"),
        (None, "candidate", CONTROLLER, "version 1 published by the trainer (step 10)")]
    assert entries[0].evidence == evidence and entries[1].evidence is None
    assert entries[0].at >= entries[1].at >= entries[2].at > 0
    assert store.get(1).state == State.REJECTED
    assert store.latest_revision() is None  # no routing change, no revision


def test_save_keeps_gate_and_analysis_without_a_transition(store):
    store.add_candidate(event(1), CONTROLLER)
    store.save(1, gate={"kl": 0.1})
    store.save(1, analysis={"pairs": 40})
    cand = store.get(1)
    assert cand.gate == {"kl": 0.1} and cand.analysis == {"pairs": 40} and cand.state == State.CANDIDATE
    assert len(store.audit(1)) == 1


def test_routing_revisions_count_up_by_one_and_are_published_once(store):
    to_state(store, 1, State.CANARY, share=0.1)  # revision 1
    assert store.latest_revision().revision == 1
    store.transition(1, State.AWAITING_APPROVAL, "controller", "analysis passed")  # no routing change
    store.transition(1, State.PROMOTED, "bob", "approved", routing=Routing(1, None, 0.0))  # revision 2
    to_state(store, 2, State.CANARY, share=0.25)  # revision 3
    revs = store.unpublished()
    assert [(r.revision, r.stable_version, r.canary_version, r.canary_share) for r in revs] == [
        (1, 0, 1, 0.1), (2, 1, None, 0.0), (3, 1, 2, 0.25)]
    assert revs[1].reason == "promoted v1: approved" and not any(r.published for r in revs)
    assert store.stable_version() == 1
    store.mark_published([1, 2])
    assert [r.revision for r in store.unpublished()] == [3]
    store.mark_published([1, 2])  # an ack repeated
    assert [r.revision for r in store.unpublished()] == [3]
    store.mark_published([3])
    assert store.unpublished() == [] and store.latest_revision().published


def test_a_reopened_store_keeps_everything(url):
    first = ReleaseStore(url)
    to_state(first, 1, State.CANARY)
    first.set_paused(True, "ops", "maintenance")
    first.close()
    again = ReleaseStore(url)  # the schema is created only if missing
    try:
        assert again.get(1).state == State.CANARY and again.latest_revision().revision == 1
        assert again.paused() and len(again.audit()) == 4
    finally:
        again.close()


def race(a: ReleaseStore, stop_after: str, first, second) -> dict[str, object]:
    """Two writers at once: ``first()`` (on store ``a``) stops inside its transaction right after
    its first statement that starts with ``stop_after``, and waits there until ``second()`` (on
    another connection) is done, or 1 s (on SQLite ``second`` waits for ``first``'s commit, as a
    PostgreSQL lock may make it). Returns each one's result or exception, as "first", "second"."""
    original, seen, second_done = a.db.execute, [], threading.Event()
    results: dict[str, object] = {}

    def execute(sql, params=()):
        out = original(sql, params)
        if sql.startswith(stop_after) and not seen:
            seen.append(sql)
            second_done.wait(1.0)
        return out

    def call(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            results[name] = exc
        if name == "second":
            second_done.set()

    a.db.execute = execute
    t1 = threading.Thread(target=call, args=("first", first))
    t1.start()
    while not seen and t1.is_alive():
        time.sleep(0.01)
    t2 = threading.Thread(target=call, args=("second", second))
    t2.start()
    t1.join(30)
    t2.join(30)
    a.db.execute = original
    return results


def test_concurrent_routing_changes_get_consecutive_revisions(url):
    # The controller rolls back one version while a person rejects another: both change the
    # routing at once. Each must get its own revision, the next one up, and neither may fail.
    a, b = ReleaseStore(url), ReleaseStore(url)
    try:
        to_state(a, 1, State.CANARY)  # revision 1
        to_state(a, 2, State.AWAITING_APPROVAL)  # revision 2
        results = race(
            a, "SELECT max(revision)",
            lambda: a.transition(1, State.ROLLED_BACK, "controller", "guardrail", routing=Routing(0, None, 0.0)),
            lambda: b.transition(2, State.REJECTED, "alice", "felt off", routing=Routing(0, None, 0.0)))
        assert results == {"first": True, "second": True}
        revs = a.unpublished()
        assert [r.revision for r in revs] == [1, 2, 3, 4]
        assert sorted(r.reason.split(":")[0] for r in revs[2:]) == ["rejected v2", "rolled_back v1"]
    finally:
        a.close()
        b.close()


def canary_of(store: ReleaseStore) -> int | None:
    rev = store.latest_revision()
    return rev.canary_version if rev else None


@pytest.mark.parametrize("stop_after", ["SELECT version, parent, state", "SELECT state FROM release_candidates"],
                         ids=["reject-read-first", "reject-inside-its-transaction"])
def test_a_reject_racing_the_gate_never_leaves_the_rejected_version_on_canary(url, stop_after):
    # A person rejects version 1 while the controller's gate finishes and starts its canary, on
    # two connections. reject-read-first: the reject has read the candidate (gating) when the
    # gate commits the canary routing; it decided "not live, no routing change" from that read,
    # and v1 ended rejected while the routing still named it, with no rollback possible.
    # reject-inside-its-transaction: the gate's transition waits for the reject's, then is refused.
    a, b = ReleaseStore(url), ReleaseStore(url)
    try:
        to_state(a, 1, State.GATING)
        results = race(a, stop_after,
                       lambda: actions.reject(a, 1, "alice", "not this one"),
                       lambda: b.transition(1, State.CANARY, "controller", "gate passed", routing=Routing(0, 1, 0.1)))
        assert results["first"] is None, results  # the reject went through either way
        assert a.get(1).state == State.REJECTED
        assert canary_of(a) is None, [(r.revision, r.canary_version, r.reason) for r in a.unpublished()]
        with pytest.raises(ActionRefused, match="no canary is live"):
            actions.rollback(a, "bob", "nothing to roll back")
    finally:
        a.close()
        b.close()


def test_rollback_removes_a_canary_whose_version_was_rejected_without_its_routing(store):
    # the state a database written before the reject/gate fix can hold: v1 rejected, the last
    # routing still sending 10 % of users to it. Rollback must still take users back to stable.
    to_state(store, 1, State.CANARY)
    store.transition(1, State.REJECTED, "alice", "raced the gate")  # no routing change, as the race left it
    assert canary_of(store) == 1
    assert actions.rollback(store, "bob", "v1 still serves canary") == 1
    rev = store.latest_revision()
    assert (rev.stable_version, rev.canary_version, rev.canary_share) == (0, None, 0.0)
    entry = store.audit(1)[0]
    assert entry.actor == "bob" and "v1 still serves canary" in entry.reason and "rejected" in entry.reason
    assert store.get(1).state == State.REJECTED  # its decision stands; only the routing changed
    with pytest.raises(ActionRefused, match="no canary is live"):
        actions.rollback(store, "bob", "again")


# -- actions -------------------------------------------------------------------------------------

def test_promote_respects_state_and_the_promotion_interval(store):
    with pytest.raises(ActionRefused, match="no version 9 was ever published"):
        actions.promote(store, 9, "bob", "ok", interval_s=0)
    to_state(store, 1, State.GATING)
    with pytest.raises(ActionRefused, match="version 1 is gating: only a version awaiting approval"):
        actions.promote(store, 1, "bob", "ok", interval_s=0)
    store.transition(1, State.CANARY, "controller", "canary", routing=Routing(0, 1, 0.1))
    store.transition(1, State.AWAITING_APPROVAL, "controller", "passed")
    assert store.last_promotion_at() is None
    actions.promote(store, 1, "bob", "looks good", interval_s=3600, evidence={"wins": 40})
    assert store.get(1).state == State.PROMOTED and store.stable_version() == 1
    assert store.last_promotion_at() == pytest.approx(time.time(), abs=5)
    assert store.audit(1)[0].actor == "bob" and store.audit(1)[0].evidence == {"wins": 40}
    rev = store.latest_revision()
    assert (rev.stable_version, rev.canary_version, rev.canary_share) == (1, None, 0.0)

    to_state(store, 2, State.AWAITING_APPROVAL)
    with pytest.raises(ActionRefused, match=r"the next promotion is allowed in \d+s "
                                            r"\(release.promotion_interval_s = 3600\)"):
        actions.promote(store, 2, "bob", "too soon", interval_s=3600)
    assert store.get(2).state == State.AWAITING_APPROVAL
    actions.promote(store, 2, "bob", "interval over", interval_s=0.0)
    assert store.stable_version() == 2
    with pytest.raises(ActionRefused, match="version 2 is promoted"):
        actions.promote(store, 2, "bob", "again", interval_s=0)


def test_held_versions_can_be_promoted_and_a_running_canary_only_by_the_policy(store):
    to_state(store, 1, State.HELD)
    actions.promote(store, 1, "bob", "a person decided", interval_s=0)
    to_state(store, 2, State.CANARY)
    # a person cannot skip the analysis of a canary still being measured
    with pytest.raises(ActionRefused, match="version 2 is canary: only a version awaiting approval"):
        actions.promote(store, 2, "bob", "looks fine to me", interval_s=0)
    actions.promote(store, 2, "auto-promote policy", "analysis passed", interval_s=0, by_policy=True)
    assert [store.get(v).state for v in (1, 2)] == [State.PROMOTED, State.PROMOTED]


def test_reject_sends_live_traffic_back_to_stable(store):
    to_state(store, 1, State.GATING)
    revisions = len(store.unpublished())
    actions.reject(store, 1, "alice", "gate failed")
    assert store.get(1).state == State.REJECTED and len(store.unpublished()) == revisions  # not live
    with pytest.raises(ActionRefused, match="version 1 is already rejected"):
        actions.reject(store, 1, "alice", "again")

    to_state(store, 2, State.AWAITING_APPROVAL)
    actions.reject(store, 2, "alice", "felt off")
    rev = store.latest_revision()
    assert (rev.stable_version, rev.canary_version, rev.canary_share) == (0, None, 0.0)
    assert rev.reason == "rejected v2: felt off"

    to_state(store, 3, State.CANARY)  # a person may turn down a canary still being measured
    actions.reject(store, 3, "alice", "no")
    rev = store.latest_revision()
    assert store.get(3).state == State.REJECTED and (rev.canary_version, rev.canary_share) == (None, 0.0)


def test_rollback_ends_the_live_canary(store):
    with pytest.raises(ActionRefused, match="no canary is live: there is nothing to roll back"):
        actions.rollback(store, "alice", "panic")
    to_state(store, 1, State.AWAITING_APPROVAL)
    actions.promote(store, 1, "bob", "ok", interval_s=0)
    to_state(store, 2, State.CANARY)
    with pytest.raises(ActionRefused, match="version 1 is not serving canary traffic"):
        actions.rollback(store, "alice", "wrong one", version=1)
    assert actions.rollback(store, "controller", "guardrail latency", evidence={"p95": 4000}) == 2
    cand = store.get(2)
    assert cand.state == State.ROLLED_BACK
    entry = store.audit(2)[0]
    assert (entry.actor, entry.reason, entry.evidence) == ("controller", "guardrail latency", {"p95": 4000})
    rev = store.latest_revision()
    assert (rev.stable_version, rev.canary_version, rev.canary_share) == (1, None, 0.0)
    with pytest.raises(ActionRefused, match="no canary is live"):
        actions.rollback(store, "alice", "again")


def test_the_canaries_run_and_passed_are_read_from_the_audit_log(store):
    """What the budget across canaries reads (release/budget.py): every canary
    started, and those whose analysis passed (canary -> awaiting approval, or -> promoted by the
    policy). A person's later approval of a held canary is no pass of its test."""
    assert store.canary_record() == (0, 0)
    to_state(store, 1, State.AWAITING_APPROVAL)  # passed
    actions.promote(store, 1, "bob", "ok", interval_s=0)
    to_state(store, 2, State.CANARY)
    actions.promote(store, 2, "auto-promote policy", "analysis passed", interval_s=0, by_policy=True)  # passed
    to_state(store, 3, State.HELD)  # no verdict by the deadline
    actions.promote(store, 3, "ann", "looks fine to me", interval_s=0)
    to_state(store, 4, State.CANARY)
    actions.rollback(store, "controller", "analysis fail")
    to_state(store, 5, State.GATING)  # gated, never canaried
    actions.reject(store, 5, "controller", "gate failed")
    assert store.canary_record() == (4, 2)
    assert store.canary_passes() == [True, True, False, False]  # in the order they started: blocks read it
    with closing(ReleaseStore(store.db.url)) as again:  # the database's counts, not the process's
        assert again.canary_record() == (4, 2) and again.canary_passes() == [True, True, False, False]


def test_pause_and_resume_are_idempotent_and_audited(store):
    assert actions.pause(store, "ops", "") is True
    assert actions.pause(store, "ops", "again") is False
    assert store.paused()
    assert actions.resume(store, "ops", "done") is True and not store.paused()
    assert actions.resume(store, "ops", "done") is False
    assert [(a.actor, a.reason) for a in store.audit()] == [("ops", "resumed: done"),
                                                             ("ops", "paused: no reason given")]


# -- the controller lease ------------------------------------------------------------------------

def test_only_one_controller_holds_the_lease_until_it_lapses(url):
    a, b = ReleaseStore(url), ReleaseStore(url)  # two connections: two controllers
    try:
        assert a.take_lease("ctrl-a", ttl_s=0.4) is True
        assert b.take_lease("ctrl-b", ttl_s=0.4) is False
        assert a.take_lease("ctrl-a", ttl_s=0.4) is True  # a renewal
        assert b.lease_holder()[0] == "ctrl-a"
        assert not any("lease" in e.reason for e in a.audit())  # taking a free lease or renewing: no entry
        time.sleep(0.5)  # a stops renewing
        assert b.take_lease("ctrl-b", ttl_s=30) is True
        assert a.take_lease("ctrl-a", ttl_s=30) is False
        holder, expires = a.lease_holder()
        assert holder == "ctrl-b" and expires > time.time() + 20
        entry = a.audit()[0]
        assert (entry.actor, entry.reason) == ("controller:ctrl-b", "took over the controller lease from ctrl-a (lapsed)")
    finally:
        a.close()
        b.close()


def test_a_controller_that_lost_the_lease_changes_nothing(url):
    # a turn that outlasted the lease (a long gate): another controller took over meanwhile, and
    # the first one's next transition and save are refused inside their own transactions
    from release.store import LeaseLost

    a, b = ReleaseStore(url), ReleaseStore(url)
    a.fence, b.fence = "ctrl-a", "ctrl-b"
    try:
        assert a.take_lease("ctrl-a", ttl_s=0.3)
        to_state(a, 1, State.CANARY)  # allowed while a holds it
        time.sleep(0.4)
        assert b.take_lease("ctrl-b", ttl_s=30)
        with pytest.raises(LeaseLost, match="ctrl-a no longer holds the controller lease \\(ctrl-b does\\)"):
            a.transition(1, State.ROLLED_BACK, "controller", "stale verdict", routing=Routing(0, None, 0.0))
        with pytest.raises(LeaseLost):
            a.save(1, analysis={"outcome": "fail"})
        assert b.get(1).state == State.CANARY and b.get(1).analysis is None
        assert b.transition(1, State.ROLLED_BACK, "controller", "the holder's verdict")
        # the API's store is not fenced: people act whoever holds the lease
        people = ReleaseStore(url)
        to_state(people, 2, State.AWAITING_APPROVAL)
        actions.promote(people, 2, "ann", "approved", interval_s=0)
        people.close()
    finally:
        a.close()
        b.close()


def test_two_controllers_starting_together_get_one_lease(url):
    # Both find no lease row; the second takes the lease while the first has looked and not yet
    # written. Exactly one may hold it, and neither may fail.
    a, b = ReleaseStore(url), ReleaseStore(url)
    try:
        results = race(a, "SELECT holder, expires_at FROM release_lease",
                       lambda: a.take_lease("ctrl-a", ttl_s=30), lambda: b.take_lease("ctrl-b", ttl_s=30))
        assert sorted(map(repr, results.values())) == ["False", "True"], results
        winner = "ctrl-a" if results["first"] is True else "ctrl-b"
        assert a.lease_holder()[0] == winner
        assert not any("lease" in e.reason for e in a.audit())  # a free lease taken: no take-over
    finally:
        a.close()
        b.close()


# -- kill -9 inside a transition -----------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    from release.states import State
    from release.store import ReleaseStore, Routing

    url, step = sys.argv[1], sys.argv[2]
    store = ReleaseStore(url)
    original = getattr(ReleaseStore, step)

    def stop_here(self, *args, **kwargs):
        original(self, *args, **kwargs)  # this step is written too, inside the transaction
        state = self.db.execute("SELECT state FROM release_candidates WHERE version=1").fetchone()[0]
        print("inside", step, state, flush=True)
        time.sleep(600)  # the test kills us here

    setattr(ReleaseStore, step, stop_here)
    store.transition(1, State.PROMOTED, "bob", "approved", {"wins": 40}, Routing(1, None, 0.0))
    print("committed", flush=True)
""")


@pytest.mark.parametrize("step", ["_audit", "_route", "_set"])
def test_a_transition_killed_midway_leaves_nothing(url, step):
    # _audit: after the state UPDATE and the audit entry; _route: after the new revision too;
    # _set: after the last write (the promotion time), just before the commit
    store = ReleaseStore(url)
    to_state(store, 1, State.AWAITING_APPROVAL)
    audit_before = [(a.id, a.to_state) for a in store.audit()]
    revisions_before = store.unpublished()
    store.close()

    child = subprocess.Popen([sys.executable, "-c", CHILD, url, step], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.split() == ["inside", step, "promoted"], line + child.stderr.read()
        # meanwhile another connection still sees the old state (the transaction is not committed)
        reader = ReleaseStore(url)
        assert reader.get(1).state == State.AWAITING_APPROVAL
        reader.close()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    again = ReleaseStore(url)
    try:
        assert again.get(1).state == State.AWAITING_APPROVAL
        assert [(a.id, a.to_state) for a in again.audit()] == audit_before
        assert again.unpublished() == revisions_before and again.stable_version() == 0
        assert again.last_promotion_at() is None
        # and the transition goes through now (PostgreSQL: once the dead backend's row lock is gone)
        assert again.transition(1, State.PROMOTED, "bob", "approved", {"wins": 40}, Routing(1, None, 0.0))
        assert again.get(1).state == State.PROMOTED and again.stable_version() == 1
        assert again.audit(1)[0].to_state == "promoted" and again.last_promotion_at() is not None
        assert [r.revision for r in again.unpublished()] == [r.revision for r in revisions_before] + [2]
    finally:
        again.close()


def test_a_dropped_database_connection_is_made_again(url):
    # a database restart or failover ends the connection: the next call works on a new one
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has no server to drop the connection")
    import psycopg

    s = ReleaseStore(url)
    try:
        to_state(s, 1, State.GATING)
        app = url.rsplit("application_name=", 1)[1]
        with psycopg.connect(url.split("?")[0], autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                          (app,))
        assert s.get(1).state == State.GATING  # a read finds the connection gone and reads again on a new one
        assert s.transition(1, State.CANARY, "controller", "after the reconnect", routing=Routing(0, 1, 0.1))
    finally:
        s.close()


def test_replicas_starting_together_on_an_empty_database_all_open_it(url):
    """The release Deployment runs two replicas, and on a fresh install both make the schema at
    once: on PostgreSQL concurrent CREATE TABLE IF NOT EXISTS of one table collide in the catalog
    (UniqueViolation on pg_type's name index), and one replica crashed and was restarted on every
    fresh install (the whole-deployment run saw it every time). Eight stores open together here."""
    barrier, errors, stores = threading.Barrier(8), [], []

    def open_one() -> None:
        barrier.wait()
        try:
            stores.append(ReleaseStore(url))
        except Exception as exc:  # noqa: BLE001 - the test reports every failure
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        assert len(stores) == 8 and all(s.current_routing() is None for s in stores)  # each reads it
    finally:
        for s in stores:
            s.close()
