"""The state store shared by a stage's replicas (``stream.database_url``, docs/shared-state.md),
on SQLite and on the real PostgreSQL: two stores on one database stand for two replicas.

A batch's state, outbox rows and offsets commit together or not at all; a process whose lease
was taken cannot commit for that shard, and a takeover waits for the transaction in progress;
sequence numbers never repeat across replicas; and every store, and the stages on it, read and
change only the shards they hold, while a shard's whole state is there for its next owner.
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import consumer_record
from prometheus_client import CollectorRegistry
from stream_db import stream_database, unique_namespace

from flywheel.contracts import (
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings, RewardSettings
from flywheel.stream import store as store_module
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.outbox import Outbox
from flywheel.stream.store import LeaseLost, StateStore
from ingest.stage import SCHEMA as INGEST_SCHEMA
from ingest.stage import IngestStage
from reward.stage import SCHEMA as REWARD_SCHEMA
from reward.stage import RewardStage

pytestmark = pytest.mark.integration

KV = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, shard INTEGER NOT NULL, v BLOB NOT NULL);"
T = Topics("u.")


@pytest.fixture(params=["sqlite", "postgres"])
def shared(request, tmp_path):
    """``open()`` -> a new store on one shared database (a replica), closed afterwards."""
    ns = unique_namespace()
    opened: list[StateStore] = []
    with stream_database(request.param, tmp_path, [ns]) as url:
        def open_store(tables: str = KV) -> StateStore:
            store = StateStore.shared_store(url, ns, tables)
            opened.append(store)
            return store

        yield open_store
        for store in opened:
            store.close()


def _kv(store: StateStore) -> dict[str, tuple[int, bytes]]:
    return {k: (shard, bytes(v)) for k, shard, v in store.db.execute("SELECT k, shard, v FROM kv")}


def test_a_batch_commits_its_state_outbox_and_offsets_together(shared):
    a, reader = shared(), shared()
    a.take([0])
    with pytest.raises(RuntimeError), a.txn():
        a.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g1", 0, b"x"))
        a.append(0, "out", "g1", b"x", archive="arch")
        a.set_offsets({("in", 0): 7})
        raise RuntimeError("the batch fails part way")
    assert (_kv(reader), reader.offsets(), reader.db.execute("SELECT count(*) FROM outbox").fetchone()[0]) == ({}, {}, 0)
    assert (a.owed, a.queued) == (0, 0)
    with a.txn():
        a.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g1", 0, b"x"))
        a.append(0, "out", "g1", b"x", archive="arch")
        a.set_offsets({("in", 0): 7})
    reader.take([0])  # (another process sees it all, as a new owner would)
    assert _kv(reader) == {"g1": (0, b"x")} and reader.offsets() == {("in", 0): 7}
    assert [(r.key, r.value) for r in reader.pending([0])] == [("g1", b"x")] and (reader.owed, reader.queued) == (1, 1)


def test_a_process_whose_lease_was_taken_cannot_commit_for_that_shard(shared):
    a, b = shared(), shared()
    a.take([0, 1])
    b.take([1])  # the group moved shard 1 to b; a has not heard yet
    with pytest.raises(LeaseLost) as lost, a.txn():
        a.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g0", 0, b"a"))
        a.append(1, "out", "g1", b"zombie")
        a.set_offsets({("in", 1): 99})
    assert lost.value.shards == {1}
    assert _kv(b) == {} and b.offsets() == {} and b.pending([0, 1]) == []  # nothing of the batch
    a.release([1])  # what the runner does with a LeaseLost: the shard is dropped
    with a.txn():
        a.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g0", 0, b"a"))
    with b.txn():
        b.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g1", 1, b"b"))
    assert _kv(a) == {"g0": (0, b"a"), "g1": (1, b"b")}
    assert a.leases.keys() == {0} and b.leases.keys() == {1}


def test_a_takeover_waits_for_the_transaction_in_progress(shared):
    """The previous owner's transaction that began before the takeover commits whole, and the new
    owner reads what it committed (PostgreSQL: the lease rows are held FOR UPDATE; SQLite: one
    writer at a time); its next one fails."""
    a = shared()
    a.take([0])
    url, ns = a.url, a.ns
    taken: list[tuple] = []

    def take_over() -> None:  # a store of its own thread (an SQLite connection is per thread)
        b = StateStore.shared_store(url, ns, KV)
        try:
            b.take([0])
            taken.append((b.offsets(), b.owed))
        finally:
            b.close()

    with a.txn():
        a.set_offsets({("in", 0): 5})
        a.append(0, "out", "g", b"late but whole")
        thread = threading.Thread(target=take_over)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not taken  # waiting for a's transaction
    thread.join(timeout=30)
    assert taken == [({("in", 0): 5}, 1)]
    with pytest.raises(LeaseLost), a.txn():
        a.set_offsets({("in", 0): 6})
    assert a.offsets() == {("in", 0): 5}


def test_seqs_are_unique_across_replicas_and_a_takeover_follows_its_predecessor(shared, monkeypatch):
    monkeypatch.setattr(store_module, "SEQ_BLOCK", 3)
    a, b = shared(), shared()
    a.take([0])
    b.take([1])
    for turn in range(5):
        for store, shard in ((a, 0), (b, 1)):
            with store.txn():
                for i in range(turn + 1):
                    store.append(shard, "out", f"{shard}-{turn}-{i}", b"v", archive="arch")
    seqs = [r.seq for r in a.pending([0], limit=100)] + [r.seq for r in b.pending([1], limit=100)]
    assert len(seqs) == 30 and len(set(seqs)) == 30
    b.take([0])  # a died; b takes its shard
    with b.txn():
        b.append(0, "out", "after", b"v")
    rows = b.pending([0], limit=100)
    assert rows[-1].key == "after" and rows[-1].seq > max(r.seq for r in rows[:-1])


def test_each_store_reads_and_counts_only_its_own_shards(shared):
    a, b = shared(), shared()
    a.take([0])
    b.take([1])
    with a.txn():
        for i in range(3):
            a.append(0, "out", f"a{i}", b"v", archive="arch")
    with b.txn():
        b.append(1, "out", "b0", b"v", archive="arch")
    assert (a.owed, a.queued, b.owed, b.queued) == (3, 3, 1, 1)
    assert {r.key for r in a.pending([0, 1])} == {"a0", "a1", "a2"}  # (asked for 1 too: no lease, no rows)
    assert [r.seq for _, rows in b.queued_batches(100) for r in rows] == [r.seq for r in b.pending([1])]
    a.release([0])
    b.take([0])  # a's shard, with its outbox and archive queue, moves to b
    assert (a.owed, a.queued, b.owed, b.queued) == (0, 0, 4, 4)
    assert {r.key for r in b.pending([0, 1])} == {"a0", "a1", "a2", "b0"}
    assert sum(len(rows) for _, rows in b.queued_batches(100)) == 4


# -- the stages on a shared store ----------------------------------------------------------------
def _gen(gid: str, t: float, user: str = "u") -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=1, user_id=user, endpoint="chat",
        created_at=t, completed_at=t, latency_ms=1, prompt_text="p", prompt_token_ids=(1,),
        completion_text="c", completion_token_ids=(2,), logprobs=(-1.0,),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")


def test_ingest_replicas_join_close_and_shift_only_their_own_windows(shared):
    cfg = IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1, emit_after_signal_s=0.0)
    a_store, b_store = shared(INGEST_SCHEMA), shared(INGEST_SCHEMA)
    a = IngestStage(cfg, T, a_store, CollectorRegistry())
    b = IngestStage(cfg, T, b_store, CollectorRegistry())
    a_store.take([0])
    b_store.take([1])
    for stage, store, shard in ((a, a_store, 0), (b, b_store, 1)):
        gid = f"g{shard}"
        fb = FeedbackEvent(feedback_id=f"f{shard}", generation_id=gid, signal="accept", created_at=101.0,
                           received_at=101.0)
        with store.txn():
            stage.process([consumer_record(T.generations, shard, 0, gid, encode(_gen(gid, 100.0))),
                           consumer_record(T.feedback, shard, 0, gid, encode(fb))], now=102.0)
    with a_store.txn():
        a.clock_stepped(-50.0)  # a's machine's clock stepped back: a's windows move, b's do not
    close_at = dict(a_store.db.execute("SELECT gid, close_at FROM gens"))
    assert close_at["g0"] == pytest.approx(102.0 - 50.0) and close_at["g1"] == pytest.approx(102.0)
    with b_store.txn():
        b.tick({0, 1}, now=103.0)  # (offered shard 0 too: it is not b's, and its window stays open)
    assert [decode(EpisodeEvent, r.value).generation_id for r in b_store.pending([1])] == ["g1"]
    assert {g for (g,) in a_store.db.execute("SELECT gid FROM gens")} == {"g0"}
    b_store.take([0])  # a died: its open window moves to b, and closes there
    with b_store.txn():
        b.tick({0, 1}, now=103.0)
    episodes = [decode(EpisodeEvent, r.value) for r in b_store.pending([0]) if r.topic == T.episodes]
    assert [(e.generation_id, e.signal) for e in episodes] == [("g0", "accept")]


def test_a_store_from_before_headers_gets_their_columns_and_an_episode_carries_its_request_id(shared):
    """Stores made before records carried headers (flywheel/telemetry.py) have neither
    ``outbox.headers`` nor ``gens.hdr``: both are added at open, on SQLite and PostgreSQL alike,
    and a generation's request id reaches its episode through them."""
    from kafka.consumer.fetcher import ConsumerRecord

    old = shared(INGEST_SCHEMA.replace(", hdr BLOB);", ");"))
    old.db.execute("ALTER TABLE outbox DROP COLUMN headers")
    assert "hdr" not in old.columns("gens") and "headers" not in old.columns("outbox")
    store = shared(INGEST_SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, grace_s=0, emit_after_signal_s=0.0), T, store, CollectorRegistry())
    assert "hdr" in store.columns("gens") and "headers" in store.columns("outbox")
    store.take([0])
    gen = consumer_record(T.generations, 0, 0, "g0", encode(_gen("g0", 100.0)))
    gen = ConsumerRecord(**{**gen._asdict(), "headers": [("flywheel-request-id", b"req-1")]})
    fb = FeedbackEvent(feedback_id="f0", generation_id="g0", signal="accept", created_at=101.0, received_at=101.0)
    with store.txn():
        stage.process([gen, consumer_record(T.feedback, 0, 0, "g0", encode(fb))], now=102.0)
    with store.txn():
        stage.tick({0}, now=103.0)
    [episode] = [r for r in store.pending([0]) if r.topic == T.episodes]
    assert episode.headers == [("flywheel-request-id", b"req-1")]


@pytest.mark.parametrize("stage", ["ingest", "reward"])
def test_replicas_starting_together_on_a_store_from_before_add_each_column_once(shared, monkeypatch, stage):
    """Replicas of a stage starting at once on a store from before a column (ingest's
    ``gens.hdr``, reward's ``seen.shard``) all find it missing; one adds it and the others go
    on (they read the columns again under the schema's lock), none fails on a duplicate column."""
    import sqlite3

    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: connect(*a, **{**k, "check_same_thread": False}))
    schema, old_schema = ((INGEST_SCHEMA, INGEST_SCHEMA.replace(", hdr BLOB);", ");")) if stage == "ingest" else
                          (REWARD_SCHEMA, REWARD_SCHEMA.replace("at REAL NOT NULL, shard INTEGER);", "at REAL NOT NULL);")))
    assert old_schema != schema
    old = shared(old_schema)
    table, column = ("gens", "hdr") if stage == "ingest" else ("seen", "shard")
    assert column not in old.columns(table)
    stores = [shared(schema) for _ in range(6)]
    start, failed = threading.Barrier(len(stores)), []

    def replica(store: StateStore) -> None:
        try:
            start.wait(10)
            if stage == "ingest":
                IngestStage(IngestSettings(), T, store, CollectorRegistry())
            else:
                RewardStage(RewardSettings(), T, store, CollectorRegistry())
        except Exception as exc:  # noqa: BLE001 - the test reports every replica's failure
            failed.append(exc)

    threads = [threading.Thread(target=replica, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failed == [] and column in old.columns(table)


def test_reward_guard_counts_move_with_their_shard(shared):
    cfg = RewardSettings()
    a_store, b_store = shared(REWARD_SCHEMA), shared(REWARD_SCHEMA)
    a = RewardStage(cfg, T, a_store, CollectorRegistry())
    b = RewardStage(cfg, T, b_store, CollectorRegistry())
    a_store.take([0])
    b_store.take([1])

    def feed(stage: RewardStage, store: StateStore, shard: int, gids: list[str]) -> None:
        eps = [EpisodeEvent(generation=_gen(g, 100.0, user="alice"), signal="accept", resolved_at=101.0) for g in gids]
        with store.txn():
            stage.process([consumer_record(T.episodes, shard, i, e.generation_id, encode(e)) for i, e in enumerate(eps)], 102.0)

    feed(a, a_store, 0, ["g1", "g2", "g3"])
    feed(b, b_store, 1, ["g4"])
    win = next(iter(a._wins))
    assert a._users[(win, "alice")][0] == 3 and b._users[(win, "alice")][0] == 1  # each over its shards
    a_store.release([0])
    a.shards_changed(set())
    b_store.take([0])
    b.shards_changed({0, 1})  # (the runner calls it once the leases are taken)
    assert a._users == {} and b._users[(win, "alice")][0] == 4 and b._wins[win][:2] == [4, 1]
    feed(b, b_store, 0, ["g1", "g5"])  # the dedupe ids moved too: g1 is a repeat
    assert b._users[(win, "alice")][0] == 5
    rewards = [r for r in b_store.pending([0, 1], limit=100) if r.topic == T.rewards]
    assert sorted(r.key for r in rewards) == ["g1", "g2", "g3", "g4", "g5"]


# -- one archive root shared by the replicas -----------------------------------------------------
class Killed(BaseException):
    """The process dies here (its open transaction is rolled back, as a dead connection's is)."""


def _parquet(root) -> ParquetArchive:
    return ParquetArchive(root, pa.schema([pa.field("v", pa.string())]), lambda v: (0.0, {"v": v.decode()}))


def _archived_seqs(root) -> list[int]:
    return sorted(s for f in _parquet(root).files() for s in pq.read_table(f).column("outbox_seq").to_pylist())


def _queue(store: StateStore, shard: int, n: int) -> list[int]:
    with store.txn():
        for i in range(n):
            store.append(shard, "out", f"{shard}-{i}", b"v%d" % i, archive="a")
    return [r.seq for _, rows in store.queued_batches(10**6) for r in rows if r.value.startswith(b"v")]


def test_a_takeover_writes_no_archive_row_its_dead_predecessor_renamed_into_the_shared_root(shared, tmp_path,
                                                                                            monkeypatch):
    """Replicas share one archive root. ``a`` renames a file of shard 0's rows into place and dies
    before taking them out of the queue; ``b``, which already wrote files of its own shard (it
    asked the files at its start, long before), takes shard 0 over: it asks the files again and
    writes only what is missing. Each row is in the root once."""
    root = tmp_path / "shared-archive"
    a, b = shared(), shared()
    a.take([0])
    b.take([1])
    box_a, box_b = Outbox(a, None, {"a": _parquet(root)}), Outbox(b, None, {"a": _parquet(root)})
    queued_b = _queue(b, 1, 3)
    assert box_b.archive(force=True) == 3  # b's files, and its look at the root, before a's crash
    queued_a = _queue(a, 0, 5)

    def die(*_):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(a, "archived", die)
        with pytest.raises(Killed):
            box_a.archive(force=True)
    assert _archived_seqs(root) == sorted(queued_b + queued_a) and a.queued == 5  # renamed, still queued
    with a.txn():
        a.append(0, "out", "0-late", b"late", archive="a")  # committed before the death, never written
    late = max(r.seq for _, rows in a.queued_batches(100) for r in rows)
    a.close()

    b.take([0])
    box_b.taken({0})  # what the runner does once the leases are taken
    assert box_b.archive(force=True) == 1 and b.queued == 0
    assert _archived_seqs(root) == sorted([*queued_b, *queued_a, late])


def test_a_takeover_waits_for_the_archive_write_in_progress_and_fences_the_next(shared, tmp_path):
    """``a``'s archive write holds its leases from before its file is written until its rows leave
    the queue: ``b``'s takeover waits for it, then finds nothing left to write. A write ``a``
    begins after the takeover (a zombie that has not heard) is fenced before it writes a file."""
    root = tmp_path / "shared-archive"
    a = shared()
    a.take([0, 1])
    url, ns = a.url, a.ns
    queued = _queue(a, 0, 4)
    taken: list[int] = []
    writing = threading.Event()

    def take_over() -> None:  # a store of its own thread (an SQLite connection is per thread)
        b = StateStore.shared_store(url, ns, KV)
        try:
            writing.wait(10)
            b.take([0])
            box = Outbox(b, None, {"a": _parquet(root)})
            box.taken({0})
            taken.append(box.archive(force=True))
        finally:
            b.close()

    class Slow(ParquetArchive):
        def write(self, epoch, rows):
            writing.set()
            time.sleep(0.5)  # the takeover asks for the lease meanwhile, and waits
            assert thread.is_alive() and not taken
            super().write(epoch, rows)

    thread = threading.Thread(target=take_over)
    thread.start()
    slow = Slow(root, pa.schema([pa.field("v", pa.string())]), lambda v: (0.0, {"v": v.decode()}))
    assert Outbox(a, None, {"a": slow}).archive(force=True) == 4
    thread.join(timeout=30)
    assert taken == [0] and _archived_seqs(root) == queued

    a.release([0])  # (the runner drops a shard it lost)
    zombie = _queue(a, 1, 2)
    b = shared()
    b.take([1])  # a has not heard
    with pytest.raises(LeaseLost):
        Outbox(a, None, {"a": _parquet(root)}).archive(force=True)
    assert _archived_seqs(root) == queued
    box_b = Outbox(b, None, {"a": _parquet(root)})
    box_b.taken({1})
    assert box_b.archive(force=True) == 2 and _archived_seqs(root) == sorted(queued + zombie)
