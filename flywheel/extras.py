"""Optional dependencies: a command that needs one says which extra installs it.

A production install (``pip install flywheel[gpu]``, the image) leaves out what only running it all
on one machine needs: the embedded broker and the demo report's plot, in the ``demo`` extra
(pyproject.toml). A command that reaches for one of them in such an install fails with
:class:`MissingExtra`, whose message names the extra; ``flywheel`` prints it and exits 2, instead
of an ``ImportError`` traceback from deep inside the command.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(RuntimeError):
    """A module this install does not hold; the message says which extra to install."""


def require(module: str, extra: str, needed_for: str, instead: str = "") -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` naming ``extra`` and what it is
    ``needed_for``; ``instead`` says what production does without it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name != module and not module.startswith(exc.name + "."):
            raise  # the module is there but one of its own imports is broken: not a missing extra
        hint = f"; {instead}" if instead else ""
        raise MissingExtra(f"{needed_for} needs the '{extra}' extra, which this install does not have "
                           f"(no module {module!r}): pip install 'flywheel[{extra}]'{hint}") from None
