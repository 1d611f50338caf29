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
