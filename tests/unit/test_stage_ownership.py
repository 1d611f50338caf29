"""Who may run a stage's shards: the store they are bound to, one live process per data_dir, and
the claims group's verdict between processes with different stores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flywheel.settings import SettingsError, load_settings
from flywheel.stream.claims import Claim, ClaimAssignor, judge
from flywheel.stream.serve import DataDirBusy, lock_data_dir
from flywheel.stream.store import ShardMismatch, StateStore


def test_store_keeps_the_shards_it_was_first_run_with(tmp_path):
    path = tmp_path / "s.sqlite3"
    store = StateStore(path)
    store.bind_shards((0, 2))
    store.close()
    again = StateStore(path)
    again.bind_shards((2, 0))  # the same set: fine
    with pytest.raises(ShardMismatch, match=r"holds the state of shards 0,2, but this process is configured for shards 1"):
        again.bind_shards((1,))
    with pytest.raises(ShardMismatch, match=r"configured for shards all \(consumer group\)"):
        again.bind_shards(())


def test_group_store_is_not_split_into_shards(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    store.bind_shards(())
    with pytest.raises(ShardMismatch, match=r"shards all \(consumer group\), but .* shards 0"):
        store.bind_shards((0,))


@pytest.mark.parametrize(("shards", "refused"), [((0, 1), False), ((0, 1, 2), False), ((0,), True)])
def test_store_from_before_shards_were_recorded(tmp_path, shards, refused):
    """Its offsets say which partitions it processed: a shard set leaving one out is refused."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        store.set_offsets({("t.generations", 0): 5, ("t.feedback", 1): 3})
    if refused:
        with pytest.raises(ShardMismatch, match=r"a set including \[1\]"):
            store.bind_shards(shards)
    else:
        store.bind_shards(shards)


def test_one_live_process_per_data_dir(tmp_path):
    first = lock_data_dir(tmp_path / "ingest", "ingest")
    with pytest.raises(DataDirBusy, match="another ingest process is running on"):
        lock_data_dir(tmp_path / "ingest", "ingest")
    lock_data_dir(tmp_path / "reward", "reward").close()  # another stage's folder is its own
    first.close()
    lock_data_dir(tmp_path / "ingest", "ingest").close()  # free again once the holder is gone


@pytest.mark.parametrize(("raw", "want"), [("1,0", (0, 1)), ("[3]", (3,)), ("", ())])
def test_shards_setting(raw, want):
    assert load_settings(env={"FLYWHEEL_INGEST_SHARDS": raw}).ingest.shards == want


@pytest.mark.parametrize(("raw", "msg"), [("1,1", "name a partition twice"), ("-1", "greater than or equal to 0")])
def test_bad_shards_setting(raw, msg):
    with pytest.raises(SettingsError, match=msg):
        load_settings(env={"FLYWHEEL_REWARD_SHARDS": raw})


def _claim(member, epoch, shards, granted=False, started=0.0, where="host:1"):
    return Claim(member, epoch, None if shards is None else frozenset(shards), granted, started, where)


@pytest.mark.parametrize(("claims", "denied"), [
    ([_claim("m1", "A", {0})], {}),
    ([_claim("m1", "A", {0}, started=1), _claim("m2", "B", {1}, started=2)], {}),
    ([_claim("m1", "A", {0, 1}, started=1), _claim("m2", "B", {1}, started=2)], {"m2": ["m1"]}),
    # a holder of a grant keeps it against a newcomer that started earlier (clock skew, restarts)
    ([_claim("m1", "A", {0}, granted=True, started=5), _claim("m2", "B", {0}, started=1)], {"m2": ["m1"]}),
    # one store's processes never collide: a restart next to its predecessor's expiring session
    ([_claim("m1", "A", {0}, granted=True, started=1), _claim("m2", "A", {0}, started=2, where="host:2")], {}),
    # ... on one machine: the same store on another is a copy of its data_dir, which collides
    ([_claim("m1", "A", {0}, granted=True, started=1), _claim("m2", "A", {0}, started=2, where="other:1")],
     {"m2": ["m1"]}),
    ([_claim("m1", "A", {0}, started=1, where="h:1"), _claim("m2", "A", {1}, started=2, where="k:1")], {}),
    # consumer-group mode claims every shard
    ([_claim("m1", "A", None, started=1), _claim("m2", "B", {3}, started=2)], {"m2": ["m1"]}),
    ([_claim("m1", "A", {3}, started=1), _claim("m2", "B", None, started=2)], {"m2": ["m1"]}),
    # a denied claim blocks nobody
    ([_claim("m1", "A", {0}, started=1), _claim("m2", "B", {0, 1}, started=2), _claim("m3", "C", {1}, started=3)],
     {"m2": ["m1"]}),
    # equal start times: member id decides
    ([_claim("m2", "B", {0}, started=1), _claim("m1", "A", {0}, started=1)], {"m2": ["m1"]}),
])
def test_judge(claims, denied):
    verdict = judge(claims)
    assert set(verdict) == {c.member for c in claims}
    assert {m: [c.member for c in hits] for m, hits in verdict.items() if hits} == denied


def test_claims_travel_through_the_assignor():
    """Member metadata out, the leader's verdicts back in: what the group protocol carries."""
    holder, newcomer = ClaimAssignor("A", (0, 1)), ClaimAssignor("B", (1,))
    newcomer.started = holder.started + 1
    members = [SimpleNamespace(member_id=m, metadata=a.metadata({"t.generations"}))
               for m, a in (("m-holder", holder), ("m-new", newcomer))]
    answers = holder.assign(None, members)  # whichever member leads runs the same judge
    holder.on_assignment(answers["m-holder"], 1)
    newcomer.on_assignment(answers["m-new"], 1)
    assert holder.denied == [] and holder.granted and holder.verdicts.is_set()
    assert [(c.epoch, c.shards) for c in newcomer.denied] == [("A", frozenset({0, 1}))]
    assert not newcomer.granted
    assert answers["m-new"].partitions() == []


@pytest.mark.parametrize(("before", "owned", "taken", "called"), [
    ({0, 1}, {0, 1}, False, False),  # nothing moved: the caches hold
    ({0}, {0, 1}, False, True),  # a shard came (or went)
    # revoked and given back in one settle, on a shared store: another replica may have held it
    # meanwhile and changed its counts, so the caches are read again though ``owned`` is the same
    ({0, 1}, {0, 1}, True, True),
])
def test_a_stage_reads_its_caches_again_whenever_its_shards_may_have_changed_hands(before, owned, taken, called):
    from flywheel.stream.runner import StreamRunner

    calls: list[set[int]] = []
    runner = SimpleNamespace(owned=owned, store=SimpleNamespace(broken=None),
                             stage=SimpleNamespace(shards_changed=calls.append))
    StreamRunner._shards_changed(runner, before, taken=taken)
    assert calls == ([owned] if called else [])
    runner.store.broken = "the database does not answer"  # read again once it is back, not now
    StreamRunner._shards_changed(runner, before, taken=True)
    assert len(calls) == int(called)
