"""The state store's outbox bookkeeping, on a real SQLite file."""

from __future__ import annotations

import time

import pytest

from flywheel.stream.store import StateStore, seq_runs


@pytest.mark.parametrize(("seqs", "runs"), [
    ([], []),
    ([5], [(5, 5)]),
    ([1, 2, 3], [(1, 3)]),
    ([3, 1, 2, 2], [(1, 3)]),
    ([1, 2, 4, 5, 9], [(1, 2), (4, 5), (9, 9)]),
    ([10, 8, 7, 12], [(7, 8), (10, 10), (12, 12)]),
])
def test_seq_runs(seqs, runs):
    assert seq_runs(seqs) == runs


def test_mark_delivered_deletes_exactly_the_given_rows_and_moves_marks(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(12):
            store.append(i % 2, "out", f"k{i}", b"v%d" % i)
    seqs = [r.seq for r in store.pending({0, 1})]
    gone = [seqs[i] for i in (0, 1, 2, 5, 7, 8, 11)]  # runs and gaps, as acks arrive
    store.mark_delivered(reversed(gone), {(0, "out", 1): 40, (1, "out", 0): 7})
    assert [r.seq for r in store.pending({0, 1})] == [s for s in seqs if s not in gone]
    assert store.out_mark(0, "out", 1) == 40 and store.out_mark(1, "out", 0) == 7
    # a shard's acks from a partition come in offset order: a lower one is a recreated topic,
    # and the point follows it down (only the marks named move)
    store.mark_delivered([], {(0, "out", 1): 30})
    assert store.out_mark(0, "out", 1) == 30 and store.out_mark(1, "out", 0) == 7


def _archive(root):
    import pyarrow as pa

    from flywheel.stream.archive import ParquetArchive

    return ParquetArchive(root, pa.schema([pa.field("v", pa.string())]), lambda v: (0.0, {"v": v.decode()}))


def test_an_archived_output_is_queued_under_its_outbox_seq(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(6):
            store.append(i % 2, "out", f"k{i}", b"v%d" % i, archive="a" if i % 3 else None)
    rows = store.pending({0, 1})
    ((first, queued),) = store.queued_batches(100)  # the batch's archive rows, as one entry
    assert first == rows[1].seq and store.queued == 4 and [q.seq for q in queued] == [r.seq for r in rows if r.key not in ("k0", "k3")]
    assert all(q.value == r.value for q in queued for r in rows if r.seq == q.seq)


def test_a_rolled_back_batch_queues_nothing_and_seqs_are_never_reused(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with pytest.raises(RuntimeError), store.txn():
        store.append(0, "out", "k", b"lost", archive="a")
        raise RuntimeError("batch failed")
    assert store.queued == 0 and store.queued_batches(10) == [] and store.pending([0]) == []
    with store.txn():
        store.append(0, "out", "k", b"v", archive="a")
    (row,) = store.pending([0])
    store.mark_delivered([row.seq], {})
    store.archived([row.seq])
    assert store.queued == 0 and store.queued_batches(10) == []
    store.close()
    # outbox ids (epoch:seq) identify records in Kafka: a restarted store with an empty outbox
    # must still number past every seq it ever gave out
    again = StateStore(tmp_path / "s.sqlite3")
    with again.txn():
        again.append(0, "out", "k", b"w", archive="a")
    assert again.pending([0])[0].seq > row.seq and again.queued_batches(10)[0][0] > row.seq


def test_the_archive_is_written_when_enough_rows_wait_or_the_oldest_is_old(tmp_path):
    from flywheel.stream.outbox import Outbox

    store = StateStore(tmp_path / "s.sqlite3")
    arch = _archive(tmp_path / "arch")
    outbox = Outbox(store, None, {"a": arch}, archive_max_rows=5, archive_max_age_s=3600)
    outbox.archive(force=True)  # nothing queued yet: nothing written

    def add(n: int) -> None:
        with store.txn():
            for i in range(n):
                store.append(0, "out", None, b"x%d" % i, archive="a")

    add(3)
    assert outbox.archive() == 0 and arch.files() == []  # 3 rows, all young
    add(3)
    assert outbox.archive() == 6 and len(arch.files()) == 1 and store.queued == 0  # whole batches
    add(5)
    add(5)
    add(1)
    assert outbox.archive() == 10 and len(arch.files()) == 3  # a file per max_rows rows ...
    assert store.queued == 1 and outbox.archive() == 0  # ... and the young rest waits
    assert outbox.archive(force=True) == 1 and store.queued == 0 and len(arch.files()) == 4
    outbox.archive_max_age_s = 0.0  # now every row is old enough
    add(2)
    assert outbox.archive() == 2 and len(arch.files()) == 5
    values = sorted(v for f in arch.files() for v in _values(f))
    assert values == sorted([f"x{i}" for n in (3, 3, 5, 5, 1, 2) for i in range(n)])


def _values(path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path).column("v").to_pylist()


def test_outbox_rows_of_an_older_store_move_to_the_archive_queue(tmp_path):
    """A store written before the archive queue existed kept archive rows in the outbox."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        store.db.executemany("INSERT INTO outbox (shard, topic, key, value, archive, archived) "
                             "VALUES (0, 'out', ?, ?, ?, ?)",
                             [("k1", b"a1", "a", 0), ("k2", b"a2", "a", 1), ("k3", b"d3", None, 0)])
    store.close()
    store = StateStore(tmp_path / "s.sqlite3")
    ((_, queued),) = store.queued_batches(10)
    assert [(q.archive, q.value) for q in queued] == [("a", b"a1")]  # k2 was archived
    assert [r.value for r in store.pending([0])] == [b"a1", b"a2", b"d3"]  # still owed to Kafka
    assert store.db.execute("SELECT count(*) FROM outbox WHERE archive IS NOT NULL").fetchone()[0] == 0


def _scraped(gauge, stage: str, store: StateStore):
    """Register ``gauge`` (a stage gauge of flywheel/stream/runner.py) for ``store``; returns a scrape."""
    from prometheus_client import generate_latest

    from flywheel.metrics import new_registry

    registry = new_registry()
    gauge(stage, store, registry)
    return lambda: generate_latest(registry).decode()


def test_archive_queue_gauge_reads_the_queue_at_scrape_time(tmp_path):
    from flywheel.stream.serve import archive_queue_gauge

    store = StateStore(tmp_path / "s.sqlite3")
    scrape = _scraped(archive_queue_gauge, "reward", store)
    with store.txn():
        for i in range(7):
            store.append(0, "out", None, b"x", archive="a" if i < 4 else None)
    assert "reward_archive_queue_rows 4.0" in scrape()
    store.archived(first for first, _ in store.queued_batches(10))
    assert "reward_archive_queue_rows 0.0" in scrape()


def test_an_archive_file_is_named_durably_before_it_is_written_off(tmp_path, monkeypatch):
    """After the rename the folder is fsynced (and the root, for a new hour's folder): the queue
    rows are dropped next, and an un-fsynced rename may not survive a node loss."""
    from flywheel.stream.store import ArchiveRow
    from ingest import archive

    synced: list = []
    monkeypatch.setattr(archive, "fsync_dir", lambda path: synced.append((path, sorted(p.name for p in path.iterdir()))))
    arch = _archive(tmp_path / "a")
    arch.write("e", [ArchiveRow(1, "a", b"x")])
    arch.write("e", [ArchiveRow(2, "a", b"y")])
    hour = tmp_path / "a" / "hour=1970-01-01T00"
    assert synced == [
        (tmp_path / "a", ["hour=1970-01-01T00"]),
        (hour, ["part-e-000000000001-000000000001.parquet"]),  # the file is in place when synced
        (hour, ["part-e-000000000001-000000000001.parquet", "part-e-000000000002-000000000002.parquet"]),
    ]


def test_pending_merges_the_shards_in_seq_order_up_to_the_limit(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(30):
            store.append(i % 3, "out", f"k{i}", b"v%d" % i)
    every = [r.seq for r in store.pending({0, 1, 2}, limit=100)]
    assert every == sorted(every) and len(every) == 30
    assert [r.seq for r in store.pending({0, 1, 2}, limit=7)] == every[:7]
    assert [r.seq for r in store.pending({2, 0}, limit=5, after=every[10])] == [s for s in every[11:] if s % 3 != 2][:5]
    assert [(s, sh) for s, sh, *_ in store.pending_keys({1})] == [(r.seq, 1) for r in store.pending({1}, limit=100)]
    with store.txn():  # no read left open holds the database: a write transaction still begins
        store.append(0, "out", None, b"after")


def test_a_large_batch_is_queued_for_the_archive_in_bounded_entries_and_written_in_bounded_parts(
        tmp_path, monkeypatch):
    """One transaction can queue more archive bytes than SQLite stores in one blob (a backlog of
    large episodes): its rows are split into entries, and an archive write takes a bounded part."""
    from flywheel.stream.outbox import Outbox
    from ingest import exactly_once

    monkeypatch.setattr(exactly_once, "QUEUE_ENTRY_BYTES", 1000)
    monkeypatch.setattr(exactly_once, "ARCHIVE_WRITE_BYTES", 3000)
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(25):
            store.append(0, "out", None, b"%03d" % i + b"x" * 297, archive="a")  # 300 bytes each
    entries = store.db.execute("SELECT first, last, rows FROM archive_queue ORDER BY first").fetchall()
    assert [n for _, _, n in entries] == [4, 4, 4, 4, 4, 4, 1] and store.queued == 25
    assert all(entries[i][1] + 1 == entries[i + 1][0] for i in range(len(entries) - 1))
    part = store.queued_batches(10**6)
    assert sum(len(rows) for _, rows in part) == 12  # entries until 3000 bytes of them are in hand
    arch = _archive(tmp_path / "arch")
    outbox = Outbox(store, None, {"a": arch}, archive_max_rows=10**6)
    assert outbox.archive(force=True) == 25 and store.queued == 0 and len(arch.files()) == 3
    assert sorted(v[:3] for f in arch.files() for v in _values(f)) == [f"{i:03d}" for i in range(25)]


class ScriptedProducer:
    """An OutputProducer whose reports the test writes: the order acks and failures come back in,
    and records the client refuses outright (pure outbox logic; the clients themselves are
    exercised against the broker in tests/integration/test_ingest_recovery.py)."""

    def __init__(self, refuse: bytes | None = None) -> None:
        self.sent: list[tuple[int, str, int, bytes]] = []
        self.script: list = []
        self.refuse = refuse

    def partitions(self, topic: str) -> int:
        return 1

    def send(self, token, topic, partition, key, value, headers) -> None:
        from flywheel.kafka.producers import RecordRefused

        if value == self.refuse:
            raise RecordRefused("larger than the client's limit")
        self.sent.append((token, topic, partition, value))

    def reports(self) -> list:
        out, self.script = self.script, []
        return out

    def flush(self, timeout_s: float) -> None:
        return None


@pytest.fixture
def scripted(tmp_path, monkeypatch):
    from ingest import exactly_once

    monkeypatch.setattr(exactly_once, "high_watermarks", lambda bootstrap, tps, **kw: {tp: 0 for tp in tps})
    monkeypatch.setattr(exactly_once, "topic_ids", lambda bootstrap, topics, **kw: {})  # (no broker here)
    store = StateStore(tmp_path / "s.sqlite3")
    yield store
    store.close()


def test_an_ack_listed_before_a_failure_to_its_partition_does_not_move_the_confirmed_point(scripted):
    """The failed record may have landed below the acked one: moving the point past it would
    hide it from the recovery scan, which would then send it again."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer()
    with store.txn():
        store.append(0, "out", "a", b"1")
        store.append(0, "out", "b", b"2")
    outbox = Outbox(store, producer, "")
    outbox.deliver({0})
    (first, _, _, _), (second, _, _, _) = producer.sent
    producer.script = [(second, "out", 0, 10, None), (first, "out", 0, -1, TimeoutError("expired"))]
    assert outbox.deliver({0}) == 1
    assert store.out_mark(0, "out", 0) == 0  # where the partition ended before the first send


def test_a_record_the_client_refuses_stays_owed_and_stalled_while_the_rest_flow(scripted):
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer(refuse=b"huge")
    with store.txn():
        for i, value in enumerate((b"a", b"huge", b"b", b"c")):
            store.append(i % 2, "out", f"k{i}", value)
    outbox = Outbox(store, producer, "")
    outbox.deliver({0, 1})
    assert [v for *_, v in producer.sent] == [b"a", b"b", b"c"]  # the rows after it went on
    producer.script = [(tok, "out", 0, n, None) for n, (tok, *_) in enumerate(producer.sent)]
    assert outbox.deliver({0, 1}) == 3 and [r.value for r in store.pending({0, 1})] == [b"huge"]
    time.sleep(0.2)
    assert outbox.stuck_s() >= 0.2 and outbox.in_flight == 0  # refused again each turn: a stall
    outbox.deliver({0})  # a shard newly assigned is set up: shard 1's refused row still counts
    assert outbox.stuck_s() >= 0.2
    outbox.release({1})  # shard 1 moved to another process, whose outbox owes the row now
    assert outbox.stuck_s() == 0.0


def test_the_rows_owed_are_counted_through_commits_rollbacks_deliveries_and_restarts(tmp_path):
    from flywheel.stream.serve import outbox_gauge

    store = StateStore(tmp_path / "s.sqlite3")
    scrape = _scraped(outbox_gauge, "ingest", store)
    with store.txn():
        for i in range(9):
            store.append(i % 2, "out", None, b"x")
    with pytest.raises(RuntimeError), store.txn():
        store.append(0, "out", None, b"lost")
        raise RuntimeError("batch failed")
    assert store.owed == 9 and "ingest_outbox_rows 9.0" in scrape()
    store.mark_delivered([r.seq for r in store.pending({0})], {})
    assert store.owed == 4
    store.mark_delivered([r.seq for r in store.pending({1})] + [10**6], {})  # an unknown seq deletes nothing
    store.close()
    again = StateStore(tmp_path / "s.sqlite3")
    assert again.owed == 0
    with again.txn():
        again.append(0, "out", None, b"y")
    again.close()
    assert StateStore(tmp_path / "s.sqlite3").owed == 1


def test_files_of_an_earlier_store_beside_the_archive_do_not_settle_a_new_stores_queue(tmp_path):
    """A state store made afresh next to an old archive numbers its rows from 1 again: the old
    files hold those numbers under another epoch, and must not count as holding the new rows."""
    from flywheel.stream.outbox import Outbox
    from flywheel.stream.store import ArchiveRow

    arch = _archive(tmp_path / "arch")
    arch.write("0ld0ld0ld0ld", [ArchiveRow(seq, "a", b"old%d" % seq) for seq in range(1, 11)])
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, "out", None, b"new%d" % i, archive="a")
    assert arch.archived_seqs(store.epoch, 1, 10) == set()
    assert Outbox(store, None, {"a": arch}).archive(force=True) == 10
    assert sorted(v for f in arch.files() for v in _values(f)) == sorted(
        [f"old{s}" for s in range(1, 11)] + [f"new{i}" for i in range(10)])


class AckingProducer(ScriptedProducer):
    """A ScriptedProducer whose flush does what a broker's would: ``on_flush`` reports come back
    (by default an ack of every send not reported yet), or flush times out (``stalled``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.stalled = False
        self.on_flush: list | None = None
        self.reported: set[int] = set()

    def send(self, token, topic, partition, key, value, headers) -> None:
        super().send(token, topic, partition, key, value, headers)
        self.reported.discard(token)  # a resend is owed its own report

    def reports(self) -> list:
        out = super().reports()
        self.reported.update(tok for tok, *_ in out)
        return out

    def flush(self, timeout_s: float) -> None:
        self.flushes += 1
        if self.stalled:
            raise TimeoutError("records still unacknowledged")
        if self.on_flush is not None:
            self.script, self.on_flush = self.script + self.on_flush, None
        else:
            self.script += [(tok, topic, part, n, None) for n, (tok, topic, part, _) in enumerate(self.sent)
                            if tok not in self.reported and tok not in {s[0] for s in self.script}]


def _owe(store: StateStore, n: int, shard: int = 0) -> None:
    with store.txn():
        for i in range(n):
            store.append(shard, "out", f"k{i}", b"v%d" % i)


def test_a_full_window_of_sends_waits_for_its_acks_and_a_slow_broker_does_not_stop_the_turn(scripted):
    """``max_in_flight`` sends at once, then the turn waits for acks; a broker slower than the
    flush timeout leaves them in flight for a later turn (or fails a turn that must wait)."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, AckingProducer()
    _owe(store, 5)
    outbox = Outbox(store, producer, "", max_in_flight=3)
    assert outbox.deliver({0}) == 3  # the window filled: flushed, acked, taken off the outbox
    assert producer.flushes == 1 and len(producer.sent) == 3 and store.owed == 2
    assert outbox.deliver({0}) == 0 and producer.flushes == 1  # 2 in flight, below the window
    assert outbox.deliver({0}, wait=True) == 2 and store.owed == 0

    _owe(store, 4)
    producer.stalled = True
    assert outbox.deliver({0}) == 0  # flush timed out: the turn goes on, the acks come later
    assert outbox.in_flight == 3 and store.owed == 4
    with pytest.raises(TimeoutError):
        outbox.deliver({0}, wait=True)  # a caller that must wait (a rebalance, a stop) is told
    producer.stalled = False
    assert outbox.flush() == 3 and outbox.deliver({0}, wait=True) == 1 and store.owed == 0
    assert [v for *_, v in producer.sent] == [b"v0", b"v1", b"v2", b"v3", b"v4", b"v0", b"v1", b"v2", b"v3"]


def test_no_end_offset_for_a_first_send_holds_the_rows_back_until_one_comes(scripted, monkeypatch):
    """A shard's first send to a partition needs that partition's end first (its confirmed
    point): while the broker gives none, nothing is sent, the outbox says why and counts as
    stalled, and the next turn that gets one sends."""
    from flywheel.stream.outbox import Outbox
    from ingest import exactly_once

    store, producer = scripted, AckingProducer()
    _owe(store, 2)

    def no_answer(bootstrap, tps, **kw):
        raise TimeoutError("no high watermark in 5s")

    monkeypatch.setattr(exactly_once, "high_watermarks", no_answer)
    outbox = Outbox(store, producer, "")
    assert outbox.deliver({0}) == 0 and producer.sent == [] and store.owed == 2
    assert outbox.blocked.startswith("no topic id or end offset for an output this run has not written to yet")
    time.sleep(0.1)
    assert outbox.stuck_s() >= 0.1
    monkeypatch.setattr(exactly_once, "high_watermarks", lambda bootstrap, tps, **kw: {tp: 0 for tp in tps})
    marks = []
    real_first_marks = store.first_marks
    monkeypatch.setattr(store, "first_marks", lambda m: (marks.append(dict(m)), real_first_marks(m)))
    assert outbox.deliver({0}, wait=True) == 2 and outbox.blocked is None and outbox.stuck_s() == 0.0
    assert marks == [{(0, "out", 0): 0}]  # the end it was given, stored before the sends
    assert store.out_mark(0, "out", 0) == 2  # then past the acks (offsets 0 and 1)
    assert len(producer.sent) == 2


@pytest.mark.parametrize("landed", [True, False])
def test_a_failed_send_with_others_in_flight_drains_them_and_settles_before_resending(scripted, monkeypatch,
                                                                                        landed):
    """A failure while later sends are in flight: the turn waits for those (so the failed row,
    below them, is read again), then the shard is settled by the recovery scan before anything is
    resent: a row that landed after all is not sent twice, one that did not is sent again."""
    from types import SimpleNamespace

    from ingest.exactly_once import OUTBOX_HEADER

    from flywheel.stream.outbox import Outbox
    from ingest import exactly_once

    store, producer = scripted, AckingProducer()
    _owe(store, 3)
    outbox = Outbox(store, producer, "")
    outbox.deliver({0})
    first, second, third = (tok for tok, *_ in producer.sent)
    producer.script = [(first, "out", 0, -1, TimeoutError("expired"))]
    producer.on_flush = [(second, "out", 0, 1, None), (third, "out", 0, 2, None)]
    assert outbox.deliver({0}) == 2 and producer.flushes == 1 and outbox.in_flight == 0
    assert [r.seq for r in store.pending({0})] == [first]

    scanned = []

    def read_to_end(bootstrap, starts, **kw):
        scanned.append(dict(starts))
        if landed:
            yield next(iter(starts)), SimpleNamespace(headers=[(OUTBOX_HEADER, store.outbox_id(first).encode())])

    monkeypatch.setattr(exactly_once, "read_to_end", read_to_end)
    sent = len(producer.sent)
    outbox.deliver({0}, wait=True)
    assert len(scanned) == 1  # settled once, from the confirmed point the failure froze
    assert [tok for tok, *_ in producer.sent[sent:]] == ([] if landed else [first])
    assert store.owed == 0
