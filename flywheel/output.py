"""``-o json`` for every command that lists something: one flag, one way to print it.

A listing prints a table for a person by default. ``-o json`` prints one JSON object on one line
on stdout instead (``release status --watch``: one line per change), for scripts and ``jq``.
Every listing's JSON keeps to one contract, so a script written today keeps working:

- the top level is always an object, never a bare list: a field can then be added beside the
  rows without breaking a reader;
- keys are snake_case; times are epoch seconds (``*_at``), durations seconds (``*_s``), sizes
  bytes; text is as stored, never terminal-escaped (JSON escapes it: ``ensure_ascii``, so no
  control or bidirectional character reaches a terminal from it either);
- new keys may appear; an existing key never changes its meaning or type; keys are sorted.

Each command's shape is listed in the README's Commands section. Diagnostics (progress, warnings,
errors) go to stderr in both modes: stdout holds the answer only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

OUTPUTS = ("table", "json")


def add_output(parser: argparse.ArgumentParser) -> None:
    """The ``-o/--output`` flag, the same on every listing command."""
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                        help="table (default) or json: one JSON object on one line, for scripts")


def as_json(body: Mapping[str, Any]) -> str:
    """One line, keys sorted, non-ASCII escaped (see the module docstring)."""
    return json.dumps(body, sort_keys=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart, ``-`` for None; every cell escaped
    (flywheel/terminal.py), since a stored text must not forge a row or move the cursor."""
    from flywheel.terminal import escape

    cells = [[escape(h) for h in headers]] + [["-" if c is None else escape(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def emit(args: argparse.Namespace, body: Mapping[str, Any], render: Callable[[Any], str],
         out: TextIO | None = None) -> None:
    """Print ``body`` as ``-o`` asks: ``render(body)`` for a person, or :func:`as_json`."""
    text = as_json(body) if getattr(args, "output", "table") == "json" else render(body)
    print(text, file=out or sys.stdout, flush=True)
