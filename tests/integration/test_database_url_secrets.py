"""A database password written raw in a URL never reaches an error: the release store and a
stage's shared state store, each opened on the real PostgreSQL driver (psycopg over libpq).

libpq ends the password at its first ``@``, then fails to resolve a host made of the password's
tail and says so (``failed to resolve host 'tail99@127.0.0.1'``); a ``%`` that starts no escape
is quoted with the whole password. Such a URL is refused, before the driver sees it, with a reason
that quotes none of it; the same password percent-encoded connects."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from conftest import release_database
from stream_db import stream_database, unique_namespace

from flywheel.settings import SettingsError
from flywheel.stream.store import StateStore
from release.store import ReleaseStore

pytestmark = pytest.mark.integration

#: Raw, each holds what a URL must escape; trust auth on the test server ignores the password.
PASSWORDS = ["s3cr3t@tail99", "pct%zz-tail77", "sl/ash@tail55"]


def leaks(text: str, password: str) -> bool:
    """Whether 4 characters in a row of ``password`` show in ``text``."""
    return any(password[i:i + 4] in text for i in range(len(password) - 3))


def with_password(url: str, password: str) -> str:
    assert url.startswith("postgresql://postgres@")
    return url.replace("postgres@", f"postgres:{password}@", 1)


def open_release(url: str, ns: str) -> ReleaseStore:
    return ReleaseStore(url)


def open_stream(url: str, ns: str) -> StateStore:
    return StateStore.shared_store(url, ns)


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize(("database", "open_store"), [(release_database, open_release),
                                                      (None, open_stream)], ids=["release", "stream"])
def test_a_raw_password_is_refused_without_showing_any_part_and_connects_encoded(tmp_path, password, database,
                                                                                 open_store):
    ns = unique_namespace()
    with (database("postgres", tmp_path) if database else stream_database("postgres", tmp_path, [ns])) as url:
        with pytest.raises(SettingsError) as refused:
            open_store(with_password(url, password), ns)
        text = f"{refused.value!r} {refused.value}"
        assert not leaks(text, password), text
        assert "percent-encode" in text, text
        opened = open_store(with_password(url, quote(password, safe="")), ns)
        opened.close()
