"""Reading an HTTP request's JSON body, for every API of the project (serving's and the release
controller's): one place that knows what JSON text a handler must refuse before it sees a value.

:func:`load_body` parses bytes and raises :class:`BodyError` with a sentence for the caller, never
anything else, for:

- text that is not UTF-8 JSON;
- JSON nested too deeply for the parser (``[`` 2,000 times): Python's ``json`` raises
  ``RecursionError``, which is no ``ValueError`` and escaped as a 500 from the release API;
- a ``\\udXXX`` escape without its pair: it parses into a string no UTF-8 encoder accepts, so the
  first write of it (a database, a Kafka record) would fail instead of the request.

Each API answers a :class:`BodyError` with its own 400 shape.
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.contracts import may_hold_surrogates


class BodyError(ValueError):
    """A request body that cannot be read as JSON; ``str()`` says why, for the caller."""


def load_body(raw: bytes) -> Any:
    """``raw`` parsed as JSON, or :class:`BodyError` (module docstring)."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError("request body is JSON nested too deeply to parse") from None
    if may_hold_surrogates(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError("request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                            "without its pair): such text cannot be stored as UTF-8") from None
    return obj


__all__ = ["BodyError", "load_body"]
