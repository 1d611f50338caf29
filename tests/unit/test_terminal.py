"""One line of plain text, and text printed escaped (flywheel/terminal.py)."""

from __future__ import annotations

import re

import pytest

from flywheel.terminal import ONE_LINE, check_one_line, escape, first_unsafe

UNSAFE = {
    "\n": ("U+000A, a control character", "\\n"),
    "\t": ("U+0009, a control character", "\\t"),
    "\x1b": ("U+001B, a control character", "\\x1b"),
    "\x7f": ("U+007F, a control character", "\\x7f"),
    "\x85": ("U+0085, a C1 control character", "\\x85"),
    "\x9b": ("U+009B, a C1 control character", "\\x9b"),
    "\u2028": ("U+2028, a line or paragraph separator", "\\u2028"),
    "\u2029": ("U+2029, a line or paragraph separator", "\\u2029"),
    "\u061c": ("U+061C, a bidirectional-text control", "\\u061c"),
    "\u200f": ("U+200F, a bidirectional-text control", "\\u200f"),
    "\u202a": ("U+202A, a bidirectional-text control", "\\u202a"),
    "\u202e": ("U+202E, a bidirectional-text control", "\\u202e"),
    "\u2066": ("U+2066, a bidirectional-text control", "\\u2066"),
    "\u2069": ("U+2069, a bidirectional-text control", "\\u2069"),
}
SAFE = ["", "approved", "très bien, 很好", "👩\u200d💻 with a joiner", "\u00a0non-breaking", "back\\slash", "\u00a0"]


@pytest.mark.parametrize("char", UNSAFE, ids=[f"U+{ord(c):04X}" for c in UNSAFE])
def test_each_unsafe_character_is_named_refused_and_escaped(char):
    named, escaped = UNSAFE[char]
    assert first_unsafe("ok " + char + " x") == f"{named}, at character 4"
    with pytest.raises(ValueError, match=f"found {re.escape(named)}"):
        check_one_line("ok " + char)
    assert escape("ok " + char + " x") == f"ok {escaped} x"
    assert not re.fullmatch(ONE_LINE, "ok " + char)


@pytest.mark.parametrize("text", SAFE)
def test_plain_text_in_any_script_is_one_line_and_prints_as_itself(text):
    assert first_unsafe(text) is None and check_one_line(text) == text and escape(text) == text
    assert re.fullmatch(ONE_LINE, text)


def test_escape_takes_anything_printable():
    assert escape(None) == "None" and escape(12) == "12"
