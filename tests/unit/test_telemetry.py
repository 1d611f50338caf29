"""Request ids and what carries them (flywheel/telemetry.py, flywheel/logs.py): which ids and
trace contexts are taken, how a JSON log line looks, and the journal and outbox keeping a record's
headers (serving/journal.py, flywheel/stream/store.py). End to end: tests/integration/test_request_ids.py."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest

from flywheel.logs import GENERATION_ID, REQUEST_ID, ContextIds, JsonFormatter
from flywheel.stream.store import StateStore
from flywheel.telemetry import (
    REQUEST_ID_HEADER,
    TRACEPARENT,
    TRACESTATE,
    carried,
    request_id_of,
    valid_request_id,
)
from serving.journal import Journal

PARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(("given", "taken"), [
    ("abc-123", "abc-123"),
    ("a.b_c:d-E", "a.b_c:d-E"),
    ("a" * 128, "a" * 128),
    (b"bytes-ok", "bytes-ok"),
    ("a" * 129, None),  # bounded: copied into every record of its request
    ("", None),
    ("two words", None),
    ("new\nline", None),  # would forge a log line
    ('quote"', None),
    ("é", None),
    (b"\xff", None),
    (None, None),
])
def test_a_request_id_is_taken_only_when_short_and_plain(given, taken):
    assert valid_request_id(given) == taken


def test_carried_keeps_valid_ids_and_trace_contexts_once_and_drops_the_rest():
    headers = [("flywheel-sig", b"x"), (REQUEST_ID_HEADER, b"r-1"), (REQUEST_ID_HEADER, b"r-2"),
               (TRACEPARENT, PARENT), (TRACESTATE, b"k=v"), ("other", b"y")]
    assert carried(headers) == [(REQUEST_ID_HEADER, b"r-1"), (TRACEPARENT, PARENT), (TRACESTATE, b"k=v")]
    assert carried([(REQUEST_ID_HEADER, b"bad id"), (TRACEPARENT, b"00-nothex"), (TRACESTATE, b"x" * 513),
                    (REQUEST_ID_HEADER, None)]) == []
    assert carried(None) == [] and request_id_of(None) is None
    assert request_id_of([(TRACEPARENT, PARENT), (REQUEST_ID_HEADER, b"r-9")]) == "r-9"


def _line(record: logging.LogRecord) -> dict:
    ContextIds().filter(record)
    text = JsonFormatter().format(record)
    assert "\n" not in text
    return json.loads(text)


def test_a_json_line_carries_the_ids_of_its_context_and_its_exception():
    logger = logging.getLogger("t.json")
    token, gtoken = REQUEST_ID.set("r-1"), GENERATION_ID.set("g-1")
    try:
        line = _line(logger.makeRecord("t.json", logging.INFO, __file__, 1, "made %d", (3,), None))
    finally:
        REQUEST_ID.reset(token)
        GENERATION_ID.reset(gtoken)
    assert line.keys() == {"time", "level", "logger", "message", "request_id", "generation_id"}
    assert (line["level"], line["logger"], line["message"], line["request_id"], line["generation_id"]) == (
        "INFO", "t.json", "made 3", "r-1", "g-1")
    assert line["time"].endswith("Z") and line["time"][10] == "T"
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        import sys

        record = logger.makeRecord("t.json", logging.ERROR, __file__, 1, "failed", (), sys.exc_info(),
                                   extra={"request_id": "named"})
    line = _line(record)
    assert line["request_id"] == "named" and "generation_id" not in line  # named wins; unknown is left out
    assert "Traceback" in line["exception"] and "ValueError: bad\nthing" in line["exception"]


def test_the_journal_keeps_headers_and_reads_frames_from_before_them(tmp_path):
    j = Journal(tmp_path, 1 << 20)
    j.append([("t.feedback", "g0", b"old")])  # (what a version without headers wrote)
    j.append([("t.generations", "g1", b"new", [(REQUEST_ID_HEADER, b"r-1"), (TRACEPARENT, PARENT)]),
              ("t.generations", None, b"", [("empty", b"")]), ("t.feedback", "g2", b"none", None)])
    j.close()
    got = Journal(tmp_path, 1 << 20).peek(10)
    assert [(e.topic, e.key, e.value, e.headers) for e in got] == [
        ("t.feedback", "g0", b"old", None),
        ("t.generations", "g1", b"new", [(REQUEST_ID_HEADER, b"r-1"), (TRACEPARENT, PARENT)]),
        ("t.generations", None, b"", [("empty", b"")]),
        ("t.feedback", "g2", b"none", None)]


def test_the_outbox_keeps_headers_and_a_store_from_before_them_gets_the_column(tmp_path):
    path = tmp_path / "s.sqlite3"
    old = sqlite3.connect(path)  # the outbox as stores were made before headers
    old.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, "
                "topic TEXT NOT NULL, key TEXT, value BLOB NOT NULL)")
    old.execute("INSERT INTO outbox (shard, topic, key, value) VALUES (0, 't', 'k0', x'00')")
    old.commit()
    old.close()
    store = StateStore(path)
    with store.txn():
        store.append(0, "t", "k1", b"v", headers=[(REQUEST_ID_HEADER, b"r-1")])
        store.append(0, "t", "k2", b"w")
    rows = store.pending([0])
    assert [(r.key, r.headers) for r in rows] == [("k0", None), ("k1", [(REQUEST_ID_HEADER, b"r-1")]), ("k2", None)]


def test_uvicorn_logs_through_the_process_handler_in_its_format():
    """uvicorn's own logging config put a text handler on its loggers: with --log-format json its
    error lines ("Exception in ASGI application") were the only text among the JSON."""
    import subprocess
    import sys

    code = ("import logging; from flywheel.logs import configure; configure('json', 'INFO'); "
            "from flywheel.connections import server_config; from flywheel.settings import HttpSettings; "
            "server_config(object(), '127.0.0.1', 0, HttpSettings()); "
            "logging.getLogger('uvicorn.error').error('boom')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stderr)["logger"] == "uvicorn.error"


def test_a_collector_password_in_its_url_is_masked_in_the_start_up_log():
    from flywheel.settings import describe, load_settings

    settings = load_settings(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel:s3cret@collector:4318/"})
    assert settings.telemetry.otlp_endpoint == "https://otel:s3cret@collector:4318"  # (the standard variable)
    shown = describe(settings)
    assert "s3cret" not in shown and "https://otel:***@collector:4318" in shown


def test_configure_adds_the_ids_filter_once_to_handlers_it_keeps():
    # a process whose root logger has someone else's handler (a test runner's capture) keeps it;
    # its records carry the context's ids all the same
    from flywheel.logs import configure

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    theirs = logging.Handler()
    seen: list[logging.LogRecord] = []
    theirs.emit = seen.append
    root.handlers[:] = [theirs]
    try:
        configure("json", "INFO")
        configure("json", "INFO")  # a second command in one process
        assert root.handlers == [theirs]
        assert sum(isinstance(f, ContextIds) for f in theirs.filters) == 1
        token = REQUEST_ID.set("r-kept")
        try:
            logging.getLogger("t.kept").warning("hello")
        finally:
            REQUEST_ID.reset(token)
        assert [r.request_id for r in seen] == ["r-kept"]
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
