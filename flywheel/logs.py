"""Log lines as text (the default) or JSON, each with the request it is about.

Every ``flywheel`` command configures logging once, in cli/main.py, from the ``log_format``
setting (``--log-format json`` or ``FLYWHEEL_LOG_FORMAT=json``) and ``log_level``. JSON is one
object per line, for a log shipper to parse without a grammar of its own::

    {"time": "2026-11-29T06:19:43.123Z", "level": "INFO", "logger": "serving.app",
     "message": "POST /v1/completions 200 in 0.412 s", "request_id": "3f2a...", "generation_id": "cmpl-..."}

``request_id`` and ``generation_id`` appear on serving's lines logged while it answers a request
(the ids of the context it was logged in: :data:`REQUEST_ID`, set by serving's middleware, and
:data:`GENERATION_ID`, set by its completion handler), or when the caller names them
(``log.error(..., extra={"request_id": rid})``, as serving's crash handler does). No other process
logs them: past serving a request id travels in the Kafka header ``flywheel-request-id`` of the
records through ingest and reward, and the trainer's ``ledger.json`` names it per generation
(docs/deploy.md, "Request ids"). An exception's traceback is the ``exception`` field, one string. The standard library only: every process already logs through it, kafka-python
and vLLM included, and their lines come out in the same format.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

#: The two formats ``log_format`` names.
LogFormat = Literal["text", "json"]

#: The text format: what every process logged before JSON existed, kept as the default.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The request id of the request being served (serving sets it per request; contextvars follow
#: the request's task and the tasks it starts, a streamed body's included).
REQUEST_ID: ContextVar[str | None] = ContextVar("flywheel_request_id", default=None)
#: The generation a line is about, when one is known.
GENERATION_ID: ContextVar[str | None] = ContextVar("flywheel_generation_id", default=None)

#: The record attributes a JSON line carries when set, in this order.
_IDS = ("request_id", "generation_id")


class ContextIds(logging.Filter):
    """Stamps each record with the ids of the context it was logged in, unless the caller named
    them (``extra=``). On the handler, so it runs for every logger's records, libraries' too."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        if getattr(record, "generation_id", None) is None:
            record.generation_id = GENERATION_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, milliseconds), level, logger, message, the ids that are
    known, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {"time": f"{at}.{int(record.msecs):03d}Z", "level": record.levelname,
                                  "logger": record.name, "message": record.getMessage()}
        for name in _IDS:
            if (value := getattr(record, name, None)) is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: a message argument that is no JSON type is already text in the message;
        # an extra field of one (a Path) is written as its text rather than failing the line
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


class _Ours(logging.StreamHandler):
    """The handler :func:`configure` installs (found again to change its format)."""


def configure(fmt: LogFormat, level: int | str) -> None:
    """Log to stderr in ``fmt`` at ``level``; called again, changes the format and the level.

    As ``logging.basicConfig``: a process whose root logger already has handlers of someone else's
    (a test runner's capture) keeps them, with the ids filter added (once), and gets no second one.
    """
    root = logging.getLogger()
    root.setLevel(level)
    ours = [h for h in root.handlers if isinstance(h, _Ours)]
    theirs = [h for h in root.handlers if not isinstance(h, (_Ours, _Held))]
    if not ours and theirs:
        for h in theirs:
            if not any(isinstance(f, ContextIds) for f in h.filters):
                h.addFilter(ContextIds())
        return
    handler = ours[0] if ours else _Ours()
    handler.setFormatter(formatter(fmt))
    if not ours:
        handler.addFilter(ContextIds())
        root.addHandler(handler)


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def held() -> Iterator[None]:
    """Hold what is logged inside the block (the settings' own warnings, logged while they load,
    before they say which format to log in) and log it after the block through the handlers
    configured by then (text if none): every line of a process has the format it was given."""
    root = logging.getLogger()
    if root.handlers:  # configured already (a second command in one process, a test runner's capture)
        yield
        return
    holder = _Held()
    root.addHandler(holder)
    try:
        yield
    finally:
        root.removeHandler(holder)
        if not root.handlers:  # the settings did not load: their error is logged as text
            configure("text", root.level or logging.INFO)
        for record in holder.records:
            for handler in root.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)
