"""Shared stream-state databases for tests (``stream.database_url``, docs/shared-state.md).

:func:`stream_database` gives an SQLite folder under the test's tmp_path, or the PostgreSQL at
``STREAM_TEST_POSTGRES_URL`` (default: the release tests' database) with every namespace the test
used dropped afterwards: the stores make their schemas themselves (flywheel/stream/sql.py), so a
test names the namespaces it will use (``namespace(group_id)``, or any unique name).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from conftest import postgres_admin

#: Not a FLYWHEEL_* name: settings parsing refuses unknown ones.
STREAM_TEST_POSTGRES_URL = os.environ.get(
    "STREAM_TEST_POSTGRES_URL", os.environ.get("RELEASE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))


def unique_namespace() -> str:
    return f"stream_test_{uuid.uuid4().hex[:12]}"


@contextmanager
def throwaway_database() -> Iterator[tuple[str, Any, str]]:
    """``(url, admin, name)``: a PostgreSQL database of its own beside ``STREAM_TEST_POSTGRES_URL``'s,
    for a test that changes what a whole database does (``ALTER DATABASE ... SET
    default_transaction_read_only``) without touching the tests running beside it; dropped
    afterwards with whatever is still connected to it. Skipped, saying why, when no PostgreSQL
    answers."""
    admin = postgres_admin(STREAM_TEST_POSTGRES_URL)
    name = f"flywheel_test_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(STREAM_TEST_POSTGRES_URL)._replace(path=f"/{name}")), admin, name
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@contextmanager
def stream_database(backend: str, tmp_path: Path, namespaces: list[str]) -> Iterator[str]:
    """A ``stream.database_url`` of ``backend`` (``sqlite`` or ``postgres``); on PostgreSQL the
    schemas named in ``namespaces`` (read at the end: a test may add to it) are dropped
    afterwards. Skipped, saying why, when no PostgreSQL answers."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'stream-state.sqlite3'}"
        return
    admin = postgres_admin(STREAM_TEST_POSTGRES_URL)
    tag = f"stream_test_{uuid.uuid4().hex[:8]}"
    sep = "&" if "?" in STREAM_TEST_POSTGRES_URL else "?"
    try:
        yield f"{STREAM_TEST_POSTGRES_URL}{sep}application_name={tag}"
    finally:
        # a killed stage's backend may hold its locks a moment longer: end it before the drop
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (tag,))
        for ns in namespaces:
            admin.execute(f'DROP SCHEMA IF EXISTS "{ns}" CASCADE')
        admin.close()
