"""The release controller rides out its database refusing writes (flywheel/dberrors.py), on the
real PostgreSQL and the real broker: a database turned read-only under it (what a failover to a
server that is still a standby looks like) neither ends its loop nor logs a traceback a turn; one
line names the error, ``release_stalled_seconds`` counts the wait (reads still work, so
``release_database_up`` does not see it), and once the database is writable again the next turn
holds the lease again on a connection of its own making (a session begun read-only stays so).
"""

from __future__ import annotations

import logging
import time

import pytest
from stream_db import throwaway_database

from flywheel.metrics import new_registry
from flywheel.settings import ReleaseSettings, Settings
from release.controller import Controller
from release.store import ReleaseStore
from release.streams import Streams

pytestmark = pytest.mark.integration


def test_the_controller_waits_out_a_read_only_database_and_holds_its_lease_again(kafka_settings, topics, tmp_path,
                                                                                 caplog):
    with throwaway_database() as (url, admin, name):
        settings = Settings(model_dir=tmp_path, data_dir=tmp_path, topic_prefix=topics.prefix,
                            kafka=kafka_settings, release=ReleaseSettings(database_url=url, tick_s=0.1,
                                                                           group_id=f"release-{topics.prefix}"))
        registry = new_registry()
        store, streams = ReleaseStore(url), Streams(settings, registry)
        try:
            controller = Controller(settings, store, streams, None, registry)
            controller.tick()
            assert controller.active and registry.get_sample_value("release_stalled_seconds") == 0
            _, expires = store.lease_holder()

            caplog.set_level(logging.INFO, logger="release.controller")
            admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            for _ in range(5):  # none raises: each is waited out
                controller.tick()
                time.sleep(0.1)
            assert registry.get_sample_value("release_stalled_seconds") > 0.3
            lines = [r.getMessage() for r in caplog.records if "25006" in r.getMessage()]
            assert len(lines) == 1 and "read-only" in lines[0] and "release database" in lines[0], lines
            assert not any(r.exc_info for r in caplog.records)

            # writable again; the controller's read-only session is left as it is
            admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')
            controller.tick()
            assert registry.get_sample_value("release_stalled_seconds") == 0
            holder, renewed = store.lease_holder()
            assert controller.active and holder == controller.holder and renewed > expires
            assert any("works again" in r.getMessage() for r in caplog.records)
        finally:
            streams.close()
            store.close()


def test_the_api_answers_503_while_the_database_is_read_only_and_works_once_it_writes(tmp_path):
    """An action while the database refuses writes is the database's state, not a bug: 503 with
    Retry-After, naming the code, never a 500; and the API's own store gets a writable session
    once the database is writable again (its read-only one would refuse for good)."""
    import httpx

    from release.api import make_app
    from release.main import ApiServer

    with throwaway_database() as (url, admin, name):
        store = ReleaseStore(url)
        api = ApiServer(make_app(store, ReleaseSettings(tokens=("ada:admin:tok-admin",))), "127.0.0.1", 0).start()
        admin_auth = {"Authorization": "Bearer tok-admin"}
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{api.port}", headers=admin_auth, timeout=10) as http:
                admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
                codes = [http.post("/api/pause", json={"reason": "maintenance"}) for _ in range(3)]
                assert all(r.status_code == 503 and r.headers["Retry-After"] == "5" for r in codes), \
                    [(r.status_code, r.text) for r in codes]
                assert "25006" in codes[-1].json()["detail"] and "read-only" in codes[-1].json()["detail"]
                admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')
                done = http.post("/api/pause", json={"reason": "maintenance"})
                assert (done.status_code, done.json()) == (200, {"paused": True, "changed": True})
        finally:
            api.stop()
            store.close()


def test_an_sqlite_release_store_opens_its_file_again_after_an_error_that_asks_for_it(tmp_path):
    """The controller's and the API's store on SQLite: a connection an error made useless (a
    file opened read-only stays so, as this connection does) is replaced at the next use, on the
    same file."""
    import sqlite3

    store = ReleaseStore(f"sqlite:///{tmp_path / 'release.sqlite3'}")
    try:
        assert store.set_paused(True, "ada", "maintenance")
        store.db.conn.execute("PRAGMA query_only=ON")  # SQLITE_READONLY on every write from here
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store.take_lease("me", 5)
        assert store.paused() is True  # the same file, opened again
        assert store.take_lease("me", 5)
    finally:
        store.close()


def test_the_controller_started_on_a_read_only_database_waits_alive_and_unready_then_starts(kafka_settings, topics,
                                                                                            tmp_path, caplog):
    """``flywheel release serve`` during a failover (its database read-only: the tables cannot be
    made) waits instead of exiting with a traceback: ``/livez`` 200 and ``/readyz`` 503 on its
    port, one line naming 25006; writable again, it starts by itself and its API is ready."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from local.broker import free_port
    from release.main import run

    def probe(path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    def until(check, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if got := check():
                    return got
            except OSError:  # the port is not open yet, or changing hands
                pass
            time.sleep(0.1)
        raise AssertionError(f"never: {what}")

    caplog.set_level(logging.WARNING)
    port = free_port()
    with throwaway_database() as (url, admin, name):
        settings = Settings(model_dir=tmp_path, data_dir=tmp_path, topic_prefix=topics.prefix, kafka=kafka_settings,
                            release=ReleaseSettings(database_url=url, tick_s=0.1, host="127.0.0.1", port=port,
                                                    group_id=f"release-{topics.prefix}"))
        admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        stop = threading.Event()
        thread = threading.Thread(target=run, args=(settings, None, stop), daemon=True)
        thread.start()
        try:
            until(lambda: probe("/readyz")[0] == 503, "the port answers while waiting")
            assert probe("/livez") == (200, {"ok": True, "starting": "waiting for the release database"})
            until(lambda: [r for r in caplog.records if "25006" in r.getMessage()], "a line names the read-only error")
            time.sleep(1.5)  # a retry or two
            assert thread.is_alive() and len([r for r in caplog.records if "25006" in r.getMessage()]) == 1
            assert not any(r.exc_info for r in caplog.records)

            admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')
            until(lambda: probe("/readyz")[0] == 200, "the API ready once the database takes writes")
            assert thread.is_alive()
        finally:
            stop.set()
            thread.join(30)
