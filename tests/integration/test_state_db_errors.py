"""Stages ride out their state database refusing work, not only going away (flywheel/dberrors.py):

- ingest on the real PostgreSQL whose database is read-only (what a failover to a server that is
  still a standby looks like) as it starts, and again under it while it runs: the stage waits
  instead of exiting, its stall grows, one log line names the read-only error, and once the
  database is writable again it goes on by itself (its retries open new sessions: one begun
  read-only stays so) with every episode out exactly once;
- a deadlock with another connection: the store names it (40P01, not a database that "does not
  answer"), lets the other transaction go on, and carries on on the same connection;
- SQLite out of space: the store waits instead of the process ending, and loses nothing.

Each database is a throwaway one (a PostgreSQL database of its own, an SQLite file under
tmp_path): other tests running at the same time are never touched.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import urllib.request

import psycopg
import pytest
from conftest import accept_feedback, read_all, running, small_generation, stage_settings
from stream_db import throwaway_database, unique_namespace

from flywheel.contracts import EpisodeEvent, decode, encode
from flywheel.kafka.clients import make_producer
from flywheel.stream.store import StateStore
from local.broker import free_port

pytestmark = pytest.mark.integration

KV = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, shard INTEGER NOT NULL, v BLOB NOT NULL);"


@pytest.fixture
def throwaway_db():
    with throwaway_database() as db:
        yield db


def _health(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:  # 503 while stalled: the body still says why
        return json.load(exc)


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = [line for line in resp.read().decode().splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def _until(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if got := check():
                return got
        except OSError:  # the ops port is not open yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def _send(kafka_settings, topics, gids: list[str]) -> None:
    producer = make_producer(kafka_settings, "test-feed")
    t = time.time()
    for gid in gids:
        producer.send(topics.generations, key=gid.encode(), value=encode(small_generation(gid, t)))
        producer.send(topics.feedback, key=gid.encode(), value=encode(accept_feedback(f"f-{gid}", gid, t)))
    producer.flush()
    producer.close()


def _episodes(kafka_settings, topics, expect: int) -> list[str]:
    recs = read_all(kafka_settings.bootstrap, topics.episodes, expect=expect, timeout_s=60)
    return [decode(EpisodeEvent, r.value).generation.generation_id for r in recs]


def test_ingest_waits_out_a_read_only_database_at_start_and_while_running_and_goes_on_exactly_once(
        kafka_settings, topics, tmp_path, throwaway_db, caplog):
    from ingest.main import run as run_ingest

    url, admin, name = throwaway_db
    port = free_port()
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_STREAM_DATABASE_URL=url,
                              FLYWHEEL_INGEST_PORT=str(port), FLYWHEEL_INGEST_WINDOW_S="0.3",
                              FLYWHEEL_INGEST_ORPHAN_WAIT_S="0.3", FLYWHEEL_INGEST_GRACE_S="0")
    caplog.set_level(logging.WARNING, logger="flywheel.stream")
    first, second = [f"a{i}" for i in range(20)], [f"b{i}" for i in range(20)]

    def read_only(on: bool) -> None:
        admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {"on" if on else "off"}')

    def logged(what: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if "25006" in r.getMessage() and what in r.getMessage()]

    read_only(True)
    with running(run_ingest, settings) as stage:
        # started during a failover: it waits, alive and not ready, instead of exiting to be restarted in a loop
        _until(lambda: logged("the state database fails at start"), "a log line names the read-only error at start",
               timeout_s=30)
        assert stage.is_alive() and _health(port) == {"ok": False, "starting": "opening the state store"}
        read_only(False)
        _until(lambda: _health(port).get("shards"), "ingest runs once the database writes")
        _send(kafka_settings, topics, first)
        assert sorted(_episodes(kafka_settings, topics, len(first))) == sorted(first)
        _until(lambda: _health(port)["owed"] == 0, "the first episodes' outbox rows deleted")

        # read-only under the running stage; its sessions end, and new ones start read-only
        read_only(True)
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        _send(kafka_settings, topics, second)
        _until(lambda: _metric(port, "ingest_stalled_seconds") >= 2, "the stall metric rises while it is read-only")
        assert stage.is_alive()
        lines = logged("the state database failed a turn")
        assert len(lines) == 1 and "read-only" in lines[0] and "ReadOnlySqlTransaction" in lines[0], lines
        assert len(logged("the state database fails at start")) == 1  # once, however many retries

        # writable again; the stage's read-only sessions are left as they are: it must open new ones
        read_only(False)
        got = _episodes(kafka_settings, topics, len(first) + len(second))
        _until(lambda: _metric(port, "ingest_stalled_seconds") == 0, "the stall ends")
        assert stage.is_alive()
    assert sorted(got) == sorted(first + second)  # each once: nothing lost, nothing doubled


def test_a_deadlocked_turn_is_named_and_goes_on_on_the_same_connection(throwaway_db):
    url, _, _ = throwaway_db
    store = StateStore.shared_store(url, unique_namespace(), KV)
    other = psycopg.connect(url, autocommit=True)
    try:
        store.take([0])
        with store.txn():
            store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("x", 0, b"0"))
        pid = store.db.execute("SELECT pg_backend_pid()").fetchone()[0]
        other.execute(f'SET search_path TO "{store.ns}"')
        other.execute("SET deadlock_timeout = '20s'")  # the store's backend (1 s) is the one to find it
        other.execute("BEGIN")
        other.execute("UPDATE kv SET v = 'o' WHERE k = 'x'")
        blocked = threading.Event()
        done: list[BaseException | None] = []

        def take_the_lease() -> None:  # waits for the store's lease lock: the cycle
            blocked.set()
            try:
                other.execute("SET statement_timeout = '5s'")
                other.execute("UPDATE leases SET term = term WHERE shard = 0")
                done.append(None)
            except psycopg.Error as exc:
                done.append(exc)

        with pytest.raises(psycopg.errors.DeadlockDetected), store.txn():  # locks lease 0, then waits on kv
            threading.Thread(target=lambda: (time.sleep(0.5), take_the_lease()), daemon=True).start()
            store.db.execute("UPDATE kv SET v = 's' WHERE k = 'x'")
        _until(lambda: done, "the other transaction goes on", timeout_s=10)
        assert done == [None]
        other.execute("COMMIT")
        assert store.describe(store.broken) == ("40P01 (deadlock) DeadlockDetected: deadlock detected")
        store.reconnect()
        assert store.db.execute("SELECT pg_backend_pid()").fetchone()[0] == pid  # no new connection needed
        with store.txn():
            store.db.execute("UPDATE kv SET v = 's' WHERE k = 'x'")
            store.set_offsets({("in", 0): 1})
        assert store.offsets() == {("in", 0): 1}
    finally:
        other.close()
        store.close()


def test_a_sqlite_store_waits_out_a_full_database_and_loses_nothing(tmp_path):
    store = StateStore(tmp_path / "state.sqlite3", KV)
    with store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("kept", 0, b"1"))
        store.append(0, "out", "kept", b"1")
        store.set_offsets({("in", 0): 1})
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full: not one page more
    with pytest.raises(sqlite3.OperationalError) as full, store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("big", 0, b"x" * 1_000_000))
        store.append(0, "out", "big", b"x")
        store.set_offsets({("in", 0): 2})
    # an error the runner waits out (it stopped the process), and the store is held until it recovers
    assert isinstance(full.value, store.lost_errors) and store.broken is full.value
    assert store.describe(full.value) == "SQLITE_FULL (database or disk is full) OperationalError: database or disk is full"
    store.db.execute("PRAGMA max_page_count = 1073741823")  # space again
    store.reconnect()
    assert (store.offsets(), store.owed, [r.key for r in store.pending([0])]) == ({("in", 0): 1}, 1, ["kept"])
    with store.txn():
        store.db.execute("INSERT INTO kv VALUES (?, ?, ?)", ("big", 0, b"x" * 1_000_000))
        store.append(0, "out", "big", b"x")
        store.set_offsets({("in", 0): 2})
    assert (store.offsets(), [r.key for r in store.pending([0])]) == ({("in", 0): 2}, ["kept", "big"])
    store.close()


def test_a_sqlite_store_opens_its_file_again_and_never_makes_a_new_empty_one(tmp_path):
    """An error that asks for a new connection (a file opened read-only stays so, as this
    connection does) opens the same file again; a file gone meanwhile is an error to wait out,
    never an empty store that would start every partition afresh."""
    path = tmp_path / "state.sqlite3"
    store = StateStore(path, KV)
    with store.txn():
        store.set_offsets({("in", 0): 5})
    store.db.execute("PRAGMA query_only=ON")  # this connection writes nothing from here
    with pytest.raises(sqlite3.OperationalError), store.txn():
        store.set_offsets({("in", 0): 6})
    assert store.broken is not None
    moved = path.rename(tmp_path / "elsewhere.sqlite3")
    with pytest.raises(sqlite3.OperationalError):
        store.reconnect()
    assert store.broken is not None and not path.exists()
    moved.rename(path)
    store.reconnect()
    assert store.broken is None and store.offsets() == {("in", 0): 5}
    with store.txn():
        store.set_offsets({("in", 0): 6})
    assert store.offsets() == {("in", 0): 6}
    store.close()


def test_a_statement_the_database_refuses_as_wrong_stops_instead_of_waiting(tmp_path):
    """A bug (a missing table; a closed connection) is no outage: the transaction rolls back and
    the error goes up, the store is not broken, and nothing waits for a reconnect that cannot fix it."""
    store = StateStore(tmp_path / "state.sqlite3", KV)
    with pytest.raises(sqlite3.OperationalError, match="no such table"), store.txn():
        store.set_offsets({("in", 0): 1})
        store.db.execute("INSERT INTO nowhere VALUES (1)")
    assert store.broken is None and store.offsets() == {}
    with store.txn():
        store.set_offsets({("in", 0): 1})
    assert store.offsets() == {("in", 0): 1}
    store.close()


def test_an_sqlite_stage_goes_on_after_its_store_opens_the_file_again_with_every_episode_once(
        kafka_settings, topics, tmp_path, caplog, monkeypatch):
    """A real ingest on its SQLite store: its connection turns read-only (SQLITE_READONLY, as a
    file opened read-only stays), the store opens the file again, and the stage writes on the new
    connection: it goes on by itself with every episode out once. A stage that kept the first
    connection wrote through a closed one for ever."""
    from ingest.main import run as run_ingest

    port = free_port()
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_INGEST_PORT=str(port),
                              FLYWHEEL_INGEST_WINDOW_S="0.3", FLYWHEEL_INGEST_ORPHAN_WAIT_S="0.3",
                              FLYWHEEL_INGEST_GRACE_S="0")
    caplog.set_level(logging.WARNING, logger="flywheel.stream")
    opened: list[sqlite3.Connection] = []
    connect = sqlite3.connect

    def shared_connect(target, *args, **kwargs):  # the test reaches the stage's connection from its thread
        conn = connect(target, *args, check_same_thread=False, **kwargs)
        if "ingest" in str(target):
            opened.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", shared_connect)
    first, second = [f"c{i}" for i in range(10)], [f"d{i}" for i in range(10)]
    with running(run_ingest, settings) as stage:
        _until(lambda: _health(port).get("shards") is not None and opened, "ingest runs")
        _send(kafka_settings, topics, first)
        assert sorted(_episodes(kafka_settings, topics, len(first))) == sorted(first)
        opened[-1].execute("PRAGMA query_only=ON")  # every write on it fails from here: SQLITE_READONLY
        _send(kafka_settings, topics, second)
        got = _episodes(kafka_settings, topics, len(first) + len(second))
        _until(lambda: _metric(port, "ingest_stalled_seconds") == 0, "the stall ends")
        assert stage.is_alive()
    lines = [r.getMessage() for r in caplog.records if "the state database failed a turn" in r.getMessage()]
    assert len(lines) == 1 and "SQLITE_READONLY" in lines[0], lines
    assert len(opened) == 2  # the file opened once more, not once per turn
    assert sorted(got) == sorted(first + second)  # each once: nothing lost, nothing doubled


def test_a_refused_login_exits_77_at_start_and_is_waited_out_while_running(throwaway_db):
    """The rule of flywheel/dberrors.py ``LoginRefused``, on the real server refusing a role's
    login (SQLSTATE class 28): at start an authentication failure that names the setting to fix
    and never the password; while running, a refusal waited out like a lost connection, the store
    going on once the role may log in again (a rotated password reaching the server first)."""
    from urllib.parse import urlsplit, urlunsplit

    from flywheel.stream.serve import DatabaseLoginRefused, until_the_database_works

    url, admin, name = throwaway_db
    role = f"r_{name[-12:]}"
    admin.execute(f'CREATE ROLE "{role}" LOGIN')
    admin.execute(f'GRANT ALL ON DATABASE "{name}" TO "{role}"')
    parts = urlsplit(url)
    as_role = urlunsplit(parts._replace(netloc=f"{role}:s3cret-pw@{parts.hostname}:{parts.port or 5432}"))
    ns = unique_namespace()

    def make() -> StateStore:
        return StateStore.shared_store(as_role, ns, KV)

    admin.execute(f'ALTER ROLE "{role}" NOLOGIN')
    with pytest.raises(DatabaseLoginRefused) as refused:
        until_the_database_works(make, as_role, threading.Event(), "ingest")
    assert refused.value.exit_code == 77
    assert "stream.database_url" in str(refused.value) and "28000" in str(refused.value)
    assert "s3cret" not in str(refused.value)

    admin.execute(f'ALTER ROLE "{role}" LOGIN')
    store = until_the_database_works(make, as_role, threading.Event(), "ingest")
    try:
        admin.execute(f'ALTER ROLE "{role}" NOLOGIN')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        with pytest.raises(psycopg.Error), store.txn():
            store.set_offsets({("in", 0): 1})
        with pytest.raises(psycopg.OperationalError, match="not permitted to log in"):
            store.reconnect()  # refused: the store stays broken, and the runner waits on
        assert store.broken is not None
        admin.execute(f'ALTER ROLE "{role}" LOGIN')
        store.reconnect()
        with store.txn():
            store.set_offsets({("in", 0): 1})
        assert store.offsets() == {("in", 0): 1}
    finally:
        store.close()
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        with psycopg.connect(url, autocommit=True) as owner:  # its schema is in the throwaway database
            owner.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


def test_a_stage_whose_statement_is_wrong_stops_instead_of_stalling(kafka_settings, topics, tmp_path, caplog):
    """A bug is no outage (flywheel/dberrors.py ``Bug``): a real ingest whose table is gone (no
    such table: SQLITE_ERROR) stops with the error, as any bug stops a stage, instead of waiting
    for ever behind a log line that blames the database."""
    from ingest.main import run as run_ingest

    port = free_port()
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_INGEST_PORT=str(port))
    stop, raised = threading.Event(), []

    def stage() -> None:
        try:
            run_ingest(settings, None, stop)
        except Exception as exc:  # noqa: BLE001 - what the process would exit with
            raised.append(exc)

    thread = threading.Thread(target=stage, daemon=True)
    thread.start()
    try:
        _until(lambda: _health(port).get("shards") is not None, "ingest runs")
        with sqlite3.connect(tmp_path / "data" / "ingest" / "state.sqlite3") as db:
            db.execute("DROP TABLE gens")
        _send(kafka_settings, topics, ["e0"])
        thread.join(60)
        assert not thread.is_alive(), "the stage waits on a statement no wait can fix"
        assert isinstance(raised[0], sqlite3.OperationalError) and "no such table" in str(raised[0])
        assert not [r for r in caplog.records if "the state database failed a turn" in r.getMessage()]
    finally:
        stop.set()
        thread.join(30)
