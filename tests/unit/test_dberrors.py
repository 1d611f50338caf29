"""The database-error judgement (flywheel/dberrors.py): one row per rule, by SQLSTATE or SQLite
error name, and the real exceptions of both drivers mapped through it."""

from __future__ import annotations

import sqlite3

import psycopg
import psycopg.errors as pg
import pytest

from flywheel.dberrors import (
    Bug,
    Conflict,
    LoginRefused,
    Reconnect,
    Retry,
    classify,
    classify_postgres,
    classify_sqlite,
    describe,
    url_secrets,
)


@pytest.mark.parametrize(("sqlstate", "want"), [
    (None, Reconnect),  # raised by the client: the connection failed or broke
    ("08006", Reconnect),  # connection failure
    ("08001", Reconnect),  # could not connect
    ("25006", Reconnect),  # read-only: a standby after a failover; only a new session may write
    ("25P03", Reconnect),  # the server ended a session idle in its transaction
    ("25P02", Reconnect),  # in a failed transaction: a new session starts clean
    ("57P01", Reconnect),  # admin shutdown (pg_terminate_backend, a restart)
    ("57P03", Reconnect),  # cannot connect now (starting up)
    ("57014", Retry),  # a statement timeout: the session lives on
    ("40P01", Retry),  # deadlock
    ("40001", Retry),  # serialization failure
    ("40003", Reconnect),  # statement completion unknown
    ("53100", Retry),  # disk full
    ("53300", Retry),  # too many connections
    ("55P03", Retry),  # lock not available
    ("58030", Retry),  # I/O error
    ("XX001", Retry),  # data corrupted: waits for a person, named in the log
    ("42P01", Bug),  # undefined table: the code's (or its migration's) error, raised
    ("42601", Bug),  # syntax error
    ("22001", Bug),  # data exception (a string too long): the data the code sends
    ("0A000", Bug),  # feature not supported
    ("28P01", LoginRefused),  # wrong password
    ("28000", LoginRefused),  # invalid authorization (a role that may not log in)
    ("P0001", Retry),  # any class nobody foresaw waits, named
    ("23505", Conflict),  # unique violation
    ("23503", Conflict),  # foreign key violation
])
def test_postgres_errors_by_sqlstate(sqlstate, want):
    outcome = classify_postgres(sqlstate)
    assert type(outcome) is want
    assert outcome.code == (sqlstate or "no SQLSTATE")


@pytest.mark.parametrize(("name", "message", "want"), [
    ("SQLITE_BUSY", "database is locked", Retry),
    ("SQLITE_BUSY_SNAPSHOT", "database is locked", Retry),
    ("SQLITE_LOCKED", "database table is locked", Retry),
    ("SQLITE_FULL", "database or disk is full", Retry),
    ("SQLITE_IOERR_FSYNC", "disk I/O error", Reconnect),
    ("SQLITE_IOERR", "disk I/O error", Reconnect),
    ("SQLITE_READONLY", "attempt to write a readonly database", Reconnect),
    ("SQLITE_READONLY_DBMOVED", "attempt to write a readonly database", Reconnect),
    ("SQLITE_CANTOPEN", "unable to open database file", Reconnect),
    ("SQLITE_CONSTRAINT_PRIMARYKEY", "UNIQUE constraint failed: t.k", Conflict),
    ("SQLITE_CORRUPT", "database disk image is malformed", Retry),
    ("SQLITE_ERROR", "no such table: t", Bug),
    # no error name (raised by the module itself): the message decides
    (None, "database is locked", Retry),
    (None, "database or disk is full", Retry),
    (None, "disk I/O error", Reconnect),
    (None, "attempt to write a readonly database", Reconnect),
    (None, "Cannot operate on a closed database.", Retry),  # by message alone nothing says what it is
    (None, "UNIQUE constraint failed: t.k", Conflict),
    (None, "something else", Retry),
])
def test_sqlite_errors_by_name_or_message(name, message, want):
    assert type(classify_sqlite(name, message)) is want


@pytest.mark.parametrize(("message", "want"), [
    (('connection failed: connection to server at "db" (10.0.0.5), port 5432 failed: FATAL:  password '
      'authentication failed for user "flywheel"'), LoginRefused("28P01", "login refused")),
    ('connection failed: FATAL:  role "flywheel" is not permitted to log in', LoginRefused("28000", "login refused")),
    ('connection failed: FATAL:  role "flywheel" does not exist', LoginRefused("28000", "login refused")),
    ('connection failed: FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "flywheel"',
     LoginRefused("28000", "login refused")),
    ("connection failed: fe_sendauth: no password supplied", LoginRefused("28P01", "login refused")),
    ('connection failed: FATAL:  database "flywheel" does not exist', Reconnect(
        "OperationalError", "connection lost or refused")),  # a database still being made: waited for
    ("connection failed: Connection refused", Reconnect("OperationalError", "connection lost or refused")),
])
def test_a_refused_login_is_told_from_a_lost_connection_by_libpqs_message(message, want):
    assert classify(psycopg.OperationalError(message)) == want


@pytest.mark.parametrize(("exc", "want"), [
    (pg.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"), Reconnect(
        "25006", "read-only")),
    (pg.DiskFull("could not extend file"), Retry("53100", "disk full")),
    (pg.DeadlockDetected("deadlock detected"), Retry("40P01", "deadlock")),
    (pg.SerializationFailure("could not serialize access"), Retry("40001", "serialization failure")),
    (pg.UniqueViolation("duplicate key"), Conflict("23505", "constraint violation")),
    (psycopg.OperationalError("connection failed"), Reconnect("OperationalError", "connection lost or refused")),
    (psycopg.InterfaceError("the connection is closed"), Reconnect("InterfaceError", "connection lost or refused")),
    (pg.InvalidPassword("password authentication failed"), LoginRefused("28P01", "login refused")),
    (pg.UndefinedTable('relation "gens" does not exist'), Bug("42P01", "syntax error or access rule violation")),
    # raised by psycopg itself, no SQLSTATE: our code's error, not a connection lost
    (psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"), Bug(
        "DataError", "statement or data refused by the driver")),
    (psycopg.ProgrammingError("the query has 2 placeholders but 1 parameters were passed"), Bug(
        "ProgrammingError", "statement or data refused by the driver")),
    (sqlite3.ProgrammingError("Cannot operate on a closed database."), Bug(
        "ProgrammingError", "misuse of the database module")),
    (sqlite3.InterfaceError("Error binding parameter 1: type 'dict' is not supported"), Bug(
        "InterfaceError", "misuse of the database module")),
])
def test_the_drivers_exceptions(exc, want):
    assert classify(exc) == want


def test_a_real_sqlite_error_is_judged_by_its_name(tmp_path):
    db = sqlite3.connect(tmp_path / "x.sqlite3")
    db.execute("CREATE TABLE t (k TEXT PRIMARY KEY)")
    db.execute("INSERT INTO t VALUES ('a')")
    with pytest.raises(sqlite3.IntegrityError) as dup:
        db.execute("INSERT INTO t VALUES ('a')")
    assert classify(dup.value) == Conflict("SQLITE_CONSTRAINT_PRIMARYKEY", "constraint violation")
    db.close()
    ro = sqlite3.connect(f"file:{tmp_path / 'x.sqlite3'}?mode=ro", uri=True)  # as a file opened read-only
    with pytest.raises(sqlite3.OperationalError) as refused:
        ro.execute("INSERT INTO t VALUES ('b')")
    assert classify(refused.value) == Reconnect("SQLITE_READONLY", "read-only database")
    ro.close()


def test_describe_names_the_code_and_message_in_one_line_and_masks_secrets():
    exc = pg.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction\nCONTEXT: ...")
    assert describe(exc) == ("25006 (read-only) ReadOnlySqlTransaction: "
                             "cannot execute INSERT in a read-only transaction")
    leaky = psycopg.OperationalError('connection to server at "db" failed: password "s3cret@x" rejected')
    line = describe(leaky, secrets=["s3cret@x"])
    assert "s3cret" not in line and "***" in line and "\n" not in line


@pytest.mark.parametrize(("url", "want"), [
    ("postgresql://flywheel:s3cret@db:5432/flywheel", ["s3cret"]),
    ("postgresql://flywheel:p%40ss@db/flywheel", ["p%40ss", "p@ss"]),  # as written and as the server sees it
    ("postgresql://flywheel@db/flywheel", []),
    ("postgresql://db/flywheel?application_name=a@b", []),  # an "@" past the query is no userinfo
    ("sqlite:////var/lib/flywheel/state.sqlite3", []),
])
def test_url_secrets_are_the_passwords_to_mask(url, want):
    assert url_secrets(url) == want
