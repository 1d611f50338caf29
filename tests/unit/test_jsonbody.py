"""Request bodies as JSON (flywheel/jsonbody.py), shared by serving's API and the release API."""

from __future__ import annotations

import pytest

from flywheel.jsonbody import BodyError, load_body


@pytest.mark.parametrize(("raw", "words"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[" * 2000 + b"]" * 2000, "nested too deeply"),
    (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
    (b'{"reason": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'["\\udfff x"]', "lone UTF-16 surrogate"),
])
def test_what_cannot_be_read_or_stored_is_a_body_error(raw, words):
    with pytest.raises(BodyError, match=words):
        load_body(raw)


def nested(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


@pytest.mark.parametrize(("raw", "value"), [
    (b'{"reason": "ok"}', {"reason": "ok"}),
    (b'"\\ud83d\\ude00"', "\N{GRINNING FACE}"),  # a paired escape is one character, and fine
    (b"[" * 100 + b"]" * 100, nested(100)),  # deeper than any real body, and fine
    (b"true", True),
])
def test_json_that_can_be_stored_is_read(raw, value):
    assert load_body(raw) == value
