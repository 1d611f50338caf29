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


def test_delivered_deletes_exactly_the_given_rows(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(12):
            store.append(i % 2, "out", f"k{i}", b"v%d" % i)
    seqs = [r.seq for r in store.pending({0, 1})]
    gone = [seqs[i] for i in (0, 1, 2, 5, 7, 8, 11)]  # runs and gaps, in the order acks arrive
    store.delivered(reversed(gone))
    left = [s for s in seqs if s not in gone]
    assert [r.seq for r in store.pending({0, 1})] == left and store.owed == 5
    store.delivered([*gone, 10**6])  # acked again, or never stored: nothing more is deleted
    assert [r.seq for r in store.pending({0, 1})] == left and store.owed == 5
    store.delivered([])
    assert store.owed == 5
    store.close()
    assert StateStore(tmp_path / "s.sqlite3").owed == 5


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
    store.delivered([row.seq])
    store.archived([row.seq])
    assert store.queued == 0 and store.queued_batches(10) == []
    store.close()
    # seqs name archive rows (and files) with the store's epoch: a restarted store with an empty
    # outbox must still number past every seq it ever gave out
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
    from flywheel.stream import archive
    from flywheel.stream.store import ArchiveRow

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
    assert {r.shard for r in store.pending({1}, limit=100)} == {1} and len(store.pending({1}, limit=100)) == 10
    with store.txn():  # no read left open holds the database: a write transaction still begins
        store.append(0, "out", None, b"after")


def test_a_large_batch_is_queued_for_the_archive_in_bounded_entries_and_written_in_bounded_parts(
        tmp_path, monkeypatch):
    """One transaction can queue more archive bytes than SQLite stores in one blob (a backlog of
    large episodes): its rows are split into entries, and an archive write takes a bounded part."""
    from flywheel.stream import store as store_mod
    from flywheel.stream.outbox import Outbox

    monkeypatch.setattr(store_mod, "QUEUE_ENTRY_BYTES", 1000)
    monkeypatch.setattr(store_mod, "ARCHIVE_WRITE_BYTES", 3000)
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
    store.delivered([r.seq for r in store.pending({0})])
    assert store.owed == 4 and "ingest_outbox_rows 4.0" in scrape()
    store.delivered([r.seq for r in store.pending({1})] + [10**6])  # an unknown seq deletes nothing
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


class ScriptedProducer:
    """An OutputProducer whose reports the test writes: the order acks and failures come back in,
    and records the client refuses outright (pure outbox logic; the clients themselves are
    exercised against the broker in tests/integration/test_ingest_recovery.py)."""

    def __init__(self, refuse: bytes | None = None) -> None:
        self.sent: list[tuple[int, str, str | None, bytes]] = []  # (token, topic, key, value)
        self.script: list[tuple[int, BaseException | None]] = []  # the reports the next call gives
        self.refuse = refuse

    def send(self, token: int, topic: str, key: str | None, value: bytes, headers=None) -> None:
        from flywheel.kafka.producers import RecordRefused

        if value == self.refuse:
            raise RecordRefused("larger than the client's limit")
        self.sent.append((token, topic, key, value))

    def reports(self) -> list[tuple[int, BaseException | None]]:
        out, self.script = self.script, []
        return out

    def flush(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None

    def tokens(self) -> list[int]:
        return [tok for tok, *_ in self.sent]

    def values(self) -> list[bytes]:
        return [value for *_, value in self.sent]


class AckingProducer(ScriptedProducer):
    """A ScriptedProducer whose flush does what a broker's would: ``on_flush`` reports come back
    (by default an ack of every send not reported yet), or flush times out (``stalled``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.stalled = False
        self.on_flush: list | None = None
        self.waiting: dict[int, None] = {}  # tokens sent and not reported yet, in send order

    def send(self, token: int, topic: str, key: str | None, value: bytes, headers=None) -> None:
        super().send(token, topic, key, value)
        self.waiting[token] = None  # a resend is owed its own report

    def reports(self) -> list[tuple[int, BaseException | None]]:
        out = super().reports()
        for tok, _ in out:
            self.waiting.pop(tok, None)
        return out

    def flush(self, timeout_s: float) -> None:
        self.flushes += 1
        if self.stalled:
            raise TimeoutError("records still unacknowledged")
        if self.on_flush is not None:
            self.script, self.on_flush = self.script + self.on_flush, None
        else:
            scripted = {tok for tok, _ in self.script}
            self.script += [(tok, None) for tok in self.waiting if tok not in scripted]


def _owe(store: StateStore, n: int, shard: int = 0) -> None:
    with store.txn():
        for i in range(n):
            store.append(shard, "out", f"k{i}", b"v%d" % i)


@pytest.fixture
def scripted(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    yield store
    store.close()


def test_a_record_the_client_refuses_stays_owed_and_stalled_while_the_rest_flow(scripted):
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer(refuse=b"huge")
    with store.txn():
        for i, value in enumerate((b"a", b"huge", b"b", b"c")):
            store.append(i % 2, "out", f"k{i}", value)
    outbox = Outbox(store, producer)
    outbox.deliver({0, 1})
    assert producer.values() == [b"a", b"b", b"c"]  # the rows after it went on
    producer.script = [(tok, None) for tok in producer.tokens()]
    assert outbox.deliver({0, 1}) == 3 and [r.value for r in store.pending({0, 1})] == [b"huge"]
    assert store.owed == 1  # still owed: refused, not lost
    time.sleep(0.2)
    assert outbox.stuck_s() >= 0.2 and outbox.in_flight == 0  # refused again each turn: a stall
    outbox.deliver({0, 1})
    assert outbox.stuck_s() >= 0.2 and producer.values() == [b"a", b"b", b"c"]  # stalled since the first refusal
    outbox.deliver({0})  # a shard newly assigned is set up: shard 1's refused row still counts
    assert outbox.stuck_s() >= 0.2
    outbox.release({1})  # shard 1 moved to another process, whose outbox owes the row now
    assert outbox.stuck_s() == 0.0


def test_a_record_refused_until_the_limit_is_raised_is_sent_then_and_the_stall_ends(scripted):
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, AckingProducer()
    producer.refuse = b"huge"
    with store.txn():
        for value in (b"a", b"huge", b"b"):
            store.append(0, "out", None, value)
    outbox = Outbox(store, producer)
    assert outbox.deliver({0}, wait=True) == 2 and outbox.stuck_s() > 0.0
    producer.refuse = None  # the operator raised the limit
    assert outbox.deliver({0}, wait=True) == 1 and store.owed == 0 and outbox.stuck_s() == 0.0
    assert producer.values() == [b"a", b"b", b"huge"]  # each sent once


def test_a_full_window_of_sends_waits_for_its_acks_and_a_slow_broker_does_not_stop_the_turn(scripted):
    """``max_in_flight`` sends at once, then the turn waits for acks; a broker slower than the
    flush timeout leaves them in flight for a later turn (or fails a turn that must wait)."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, AckingProducer()
    _owe(store, 5)
    outbox = Outbox(store, producer, max_in_flight=3)
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
    assert producer.values() == [b"v0", b"v1", b"v2", b"v3", b"v4", b"v0", b"v1", b"v2", b"v3"]
    assert len(set(producer.tokens())) == 9  # nothing was sent twice: every send was acked


def test_a_failed_send_is_sent_again_once_the_sends_in_flight_drain_and_deleted_once_acked(scripted):
    """A failure while later sends are in flight: the turn waits for those (the failed row, below
    them, is read again only once nothing above it is in flight), then the failed row alone is sent
    again, and it leaves the outbox when that send is acked. It may have landed the first time:
    the record can reach its topic twice, which its readers drop by key (at least once)."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, AckingProducer()
    _owe(store, 3)
    outbox = Outbox(store, producer)
    outbox.deliver({0})
    first, second, third = producer.tokens()
    producer.script = [(first, TimeoutError("expired"))]
    producer.on_flush = [(second, None), (third, None)]
    assert outbox.deliver({0}) == 2 and producer.flushes == 1 and outbox.in_flight == 0
    assert [r.seq for r in store.pending({0})] == [first] and store.owed == 1
    assert producer.tokens() == [first, second, third]  # not resent inside the failing turn
    time.sleep(0.05)
    assert outbox.stuck_s() >= 0.05  # failing since its first failure, although the others landed

    assert outbox.deliver({0}) == 0 and producer.tokens() == [first, second, third, first]  # sent again
    assert outbox.in_flight == 1 and store.owed == 1  # still owed: not acked yet
    assert outbox.deliver({0}, wait=True) == 1 and store.owed == 0 and store.pending({0}) == []
    assert outbox.stuck_s() == 0.0
    assert outbox.deliver({0}, wait=True) == 0 and len(producer.sent) == 4  # gone: never sent again


def test_a_send_that_fails_again_and_again_is_resent_every_turn_until_it_lands(scripted):
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer()
    _owe(store, 1)
    outbox = Outbox(store, producer)
    outbox.deliver({0})
    for attempt in range(2, 5):
        producer.script = [(producer.tokens()[-1], TimeoutError("expired"))]
        assert outbox.deliver({0}) == 0 and outbox.in_flight == 0  # the failure collected
        outbox.deliver({0})  # and the row sent again on the next turn
        assert len(producer.sent) == attempt and store.owed == 1 and outbox.in_flight == 1
    producer.script = [(producer.tokens()[-1], None)]
    assert outbox.deliver({0}) == 1 and store.owed == 0
    assert producer.values() == [b"v0"] * 4 and outbox.stuck_s() == 0.0


def test_a_row_acked_is_deleted_exactly_once(scripted, monkeypatch):
    """A report for a row no longer in flight (a repeated report) deletes nothing more, and a
    row acked is never sent again."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer()
    _owe(store, 4)
    deleted: list[int] = []
    real_delivered = store.delivered

    def delivered(seqs):
        seqs = list(seqs)
        deleted.extend(seqs)
        real_delivered(seqs)

    monkeypatch.setattr(store, "delivered", delivered)
    outbox = Outbox(store, producer)
    outbox.deliver({0})
    t1, t2, t3, t4 = producer.tokens()
    producer.script = [(t1, None), (t2, None), (t1, None)]
    assert outbox.deliver({0}) == 2 and store.owed == 2
    producer.script = [(t2, None), (t1, TimeoutError("late")), (t3, None)]  # t1's: not in flight
    assert outbox.deliver({0}) == 1 and store.owed == 1 and outbox.in_flight == 1
    producer.script = [(t4, None)]
    assert outbox.deliver({0}) == 1 and store.owed == 0
    assert sorted(deleted) == [t1, t2, t3, t4]  # each deleted once
    assert outbox.deliver({0}, wait=True) == 0 and producer.tokens() == [t1, t2, t3, t4]  # none resent


def test_rows_left_in_the_store_by_a_crash_are_all_sent_again(tmp_path):
    """Killed with sends in flight, one failed and some never sent: the next start (a new store
    object on the same file, a new producer) sends every row still in the outbox, those that may
    have landed included, and none that was acked before the crash."""
    from flywheel.stream.outbox import Outbox

    path = tmp_path / "s.sqlite3"
    store = StateStore(path)
    with store.txn():
        for i in range(8):
            store.append(i % 2, "out", f"k{i}", b"v%d" % i)
    before = ScriptedProducer()
    outbox = Outbox(store, before, max_in_flight=6)
    outbox.deliver({0, 1})  # v0-v5 in flight, v6 and v7 not sent yet
    tok = before.tokens()
    assert before.values() == [b"v%d" % i for i in range(6)]
    before.script = [(tok[0], None), (tok[3], None), (tok[1], TimeoutError("expired"))]
    outbox.deliver({0, 1})
    assert store.owed == 6
    store.close()  # the crash: v1 failed, v2, v4 and v5 in flight, v6 and v7 never sent

    again = StateStore(path)
    assert again.owed == 6
    after = AckingProducer()
    assert Outbox(again, after).deliver({0, 1}, wait=True) == 6
    assert after.values() == [b"v1", b"v2", b"v4", b"v5", b"v6", b"v7"]  # in seq order, each once
    assert again.owed == 0 and again.pending({0, 1}) == []
    again.close()
    assert StateStore(path).owed == 0


def test_release_forgets_the_rows_of_shards_that_moved(scripted):
    """Shards that moved to another process are no longer this outbox's: their sends in flight
    and failures are forgotten (their reports count for nothing here, nor do they stall it), and
    its later turns send nothing of them. Their rows stay in the store, sent again if the shard
    comes back."""
    from flywheel.stream.outbox import Outbox

    store, producer = scripted, ScriptedProducer()
    with store.txn():
        for name in (b"a0", b"b0", b"a1", b"b1"):  # shard 0: a*, shard 1: b*
            store.append(0 if name.startswith(b"a") else 1, "out", name.decode(), name)
    outbox = Outbox(store, producer)
    outbox.deliver({0, 1})
    a0, b0, a1, b1 = producer.tokens()
    producer.script = [(b0, TimeoutError("expired"))]
    assert outbox.deliver({0, 1}) == 0 and outbox.in_flight == 3
    time.sleep(0.05)
    assert outbox.stuck_s() >= 0.05

    outbox.release({1})
    assert outbox.in_flight == 2  # a0 and a1
    producer.script = [(a0, None), (b1, None), (a1, None)]
    assert outbox.deliver({0}) == 2  # b1's ack is not this outbox's any more
    assert outbox.in_flight == 0 and outbox.stuck_s() == 0.0  # b0's failure no longer stalls it
    assert [r.value for r in store.pending({0, 1})] == [b"b0", b"b1"] and store.owed == 2
    assert outbox.deliver({0}) == 0 and len(producer.sent) == 4  # nothing of shard 1 sent

    outbox.deliver({1})  # shard 1 assigned here again: its rows go out again
    assert producer.values()[4:] == [b"b0", b"b1"]
    producer.script = [(b0, None), (b1, None)]
    assert outbox.deliver({1}) == 2 and store.owed == 0
