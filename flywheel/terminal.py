"""Text people read in a terminal: what an API refuses as one line of text, and how a CLI prints
text it did not write (a database row, a Kafka record) so that the text cannot forge the output.

One definition of the characters that can change what a person sees, beyond the characters
themselves (an outside review forged an audit row in ``flywheel release audit`` with them):

- C0 controls and DEL (U+0000-U+001F, U+007F): a line break starts a fake row, ESC starts an
  escape sequence that moves the cursor, recolours or clears the screen;
- C1 controls (U+0080-U+009F): U+009B is CSI to a terminal that takes 8-bit controls, U+0085 a
  line break;
- line and paragraph separators (U+2028, U+2029): a line break to many viewers;
- bidirectional controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069): they reorder
  what is shown ("Trojan Source"), so "approved" can read as something else.

Joiners (U+200D) and other format characters are left alone: emoji and several scripts need them,
and they forge nothing. :data:`ONE_LINE` is the same set as a regular expression, for a schema.
"""

from __future__ import annotations

import re

#: The character class (module docstring), in the escapes both Python's ``re`` and pydantic's
#: Rust regex read the same way.
UNSAFE_CLASS = r"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
#: A regular expression matching one line of text without any of them (an API field's ``pattern``).
ONE_LINE = f"^[^{UNSAFE_CLASS}]*$"
_UNSAFE = re.compile(f"[{UNSAFE_CLASS}]")
#: What each kind is called in a message.
_KINDS = ((0x00, 0x1F, "a control character"), (0x7F, 0x7F, "a control character"),
          (0x80, 0x9F, "a C1 control character"), (0x2028, 0x2029, "a line or paragraph separator"))


def first_unsafe(text: str) -> str | None:
    """Why ``text`` is not one line of plain text (``U+202E, a bidirectional-text control, at
    character 10``), or None when it is."""
    found = _UNSAFE.search(text)
    if found is None:
        return None
    code = ord(found.group())
    kind = next((name for lo, hi, name in _KINDS if lo <= code <= hi), "a bidirectional-text control")
    return f"U+{code:04X}, {kind}, at character {found.start() + 1}"


def check_one_line(text: str) -> str:
    """``text`` if it is one line of plain text, else ``ValueError`` saying which character is not
    (pydantic turns it into the field's error; argparse's ``type=`` into a usage error)."""
    why = first_unsafe(text)
    if why is not None:
        raise ValueError(f"must be one line of text without control, C1, line-separator or "
                         f"bidirectional-text characters: found {why}")
    return text


def escape(text: object) -> str:
    """``str(text)`` with every such character written as a Python escape (``\\n``, ``\\x1b``,
    ``\\u202e``): printed, it shows what is stored and changes nothing on the screen. Everything
    else, other scripts and emoji included, prints as itself."""
    return _UNSAFE.sub(_escaped, str(text))


def _escaped(m: re.Match[str]) -> str:
    return repr(m.group())[1:-1]


__all__ = ["ONE_LINE", "UNSAFE_CLASS", "check_one_line", "escape", "first_unsafe"]
