"""A shared state store on the real PostgreSQL whose connections are ended under it (a server
restart, a failover): the transaction in progress raises, the store refuses every transaction
until it has reconnected and its ``on_rollback`` hooks have read their caches again, nothing of
the failed transaction is committed, and the leases are still checked after the reconnect.
"""

from __future__ import annotations

import psycopg
import pytest
from stream_db import STREAM_TEST_POSTGRES_URL, stream_database, unique_namespace

from flywheel.stream.store import DatabaseLost, LeaseLost, StateStore

pytestmark = pytest.mark.integration

KV = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, shard INTEGER NOT NULL, v BLOB NOT NULL);"


@pytest.fixture
def pg(tmp_path):
    """``open()`` -> a new store on a throwaway schema of the test database, and an admin connection."""
    ns = unique_namespace()
    opened: list[StateStore] = []
    with stream_database("postgres", tmp_path, [ns]) as url:
        admin = psycopg.connect(STREAM_TEST_POSTGRES_URL, autocommit=True)

        def open_store() -> StateStore:
            store = StateStore.shared_store(url, ns, KV)
            opened.append(store)
            return store

        yield open_store, admin
        for store in opened:
            store.close()
        admin.close()


def _end_connections(admin, store: StateStore) -> None:
    """End the store's own backends (its batch connection and its sequence one), nobody else's."""
    pids = [conn.execute("SELECT pg_backend_pid()").fetchone()[0] for conn in (store.db, store._seq_db)]
    ended = admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,)).fetchall()
    assert ended == [(True,), (True,)]


def _kv(store: StateStore) -> dict[str, bytes]:
    return {k: bytes(v) for k, v in store.db.execute("SELECT k, v FROM kv")}


def test_a_transaction_cut_off_by_a_lost_connection_leaves_nothing_and_the_store_comes_back(pg):
    open_store, admin = pg
    store, reader = open_store(), open_store()
    store.take([0])
    cache: list[dict[str, bytes]] = []  # a stage's in-memory copy of state (reward's guard counts)
    store.on_rollback(lambda: cache.append(_kv(store)))
    with store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g0", 0, b"before"))
        store.append(0, "out", "g0", b"before")
        store.set_offsets({("in", 0): 1})
    seq_before = max(r.seq for r in store.pending([0]))

    with pytest.raises(store.lost_errors), store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g1", 0, b"lost"))
        store.append(0, "out", "g1", b"lost")
        store.set_offsets({("in", 0): 2})
        _end_connections(admin, store)
        store.db.execute("SELECT 1")  # the batch's next statement
    assert store.broken is not None and cache == []  # the hooks wait for a connection
    with pytest.raises(DatabaseLost), store.txn():  # nothing runs on a broken store
        pass
    assert (_kv(reader), reader.offsets()) == ({"g0": b"before"}, {("in", 0): 1})

    store.reconnect()
    assert store.broken is None and cache == [{"g0": b"before"}]  # read again on the new connection
    assert (store.owed, [r.key for r in store.pending([0])]) == (1, ["g0"])
    with store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("g1", 0, b"again"))
        store.append(0, "out", "g1", b"again")
        store.set_offsets({("in", 0): 2})
    rows = store.pending([0])
    assert (_kv(reader), reader.offsets()) == ({"g0": b"before", "g1": b"again"}, {("in", 0): 2})
    # a fresh block of seqs: the failed COMMIT might have landed with the ones after seq_before
    assert [r.key for r in rows] == ["g0", "g1"] and rows[1].seq > seq_before and store.owed == 2


def test_a_store_that_reconnects_still_finds_its_lease_taken_meanwhile(pg):
    open_store, admin = pg
    store, other = open_store(), open_store()
    store.take([0, 1])
    _end_connections(admin, store)  # between batches: the next one's first statement finds out
    with pytest.raises(store.lost_errors), store.txn():
        pass
    other.take([1])  # the group gave shard 1 to another replica while this one was cut off
    store.release([])  # (nothing to recount on a broken store: reconnect does)
    store.reconnect()
    with pytest.raises(LeaseLost) as lost, store.txn():
        store.set_offsets({("in", 1): 9})
    assert lost.value.shards == {1} and other.offsets() == {}
    store.release([1])
    with store.txn():
        store.set_offsets({("in", 0): 3})
    assert other.offsets() == {("in", 0): 3}


def test_a_reconnect_while_the_database_does_not_answer_raises_and_keeps_the_store_broken(pg):
    open_store, admin = pg
    store = open_store()
    _end_connections(admin, store)
    with pytest.raises(store.lost_errors), store.txn():
        pass
    url = store.db.url
    store.db.url = store._seq_db.url = "postgresql://postgres@127.0.0.1:1/nowhere"  # nothing listens
    with pytest.raises(store.lost_errors):
        store.reconnect()
    assert store.broken is not None
    store.db.url = store._seq_db.url = url
    store.reconnect()
    with store.txn():
        store.set_offsets({("in", 0): 1})
    assert store.offsets() == {("in", 0): 1}


def test_the_server_drops_a_dead_replicas_session_and_its_locks_in_seconds_not_hours(pg):
    """A replica whose machine dies mid-transaction sends no FIN: the server keeps its session, and
    the lease rows it locked, for as long as TCP keepalive takes to give up. Every connection of a
    store asks for keepalives of seconds and ends a session idle in a transaction after 5 minutes,
    reconnects included (flywheel/stream/sql.py SESSION_OPTIONS), so a takeover waits that long at most."""
    open_store, admin = pg
    store = open_store()

    def session(conn) -> dict[str, str]:
        names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count",
                 "idle_in_transaction_session_timeout")
        return {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in names}

    want = {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3",
            "idle_in_transaction_session_timeout": "5min"}
    assert session(store.db) == session(store._seq_db) == want
    assert session(admin) != want  # the check can fail: a plain connection has the server's defaults
    _end_connections(admin, store)
    with pytest.raises(store.lost_errors), store.txn():
        pass
    store.reconnect()
    assert session(store.db) == session(store._seq_db) == want
