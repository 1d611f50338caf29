"""Progress of long work, told by the code that does it and drawn by the command that runs it.

Importing a model, rebuilding a checkpoint from its delta chain, verifying or merging one reads,
hashes and writes gigabytes: minutes on a real model, with nothing to show that it is not stuck.
The code doing that work takes a :class:`Progress` and reports each step's bytes as it goes::

    with progress.task("hash v00000007", total=size) as task:
        for block in blocks:
            ...
            task.advance(len(block))

It never decides how, or whether, that is shown: :data:`SILENT` (the default everywhere, and what
the stages use) shows nothing; :func:`for_terminal` draws one tqdm bar per task on stderr, and only
when stderr is a terminal. stdout is never written: a command's answer there may be parsed, and a
log file or a pipe gets no carriage-return noise. tqdm is a dependency of its own (pyproject.toml),
already what transformers and DeepSpeed draw their bars with.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import IO, Any, Protocol


class Task(AbstractContextManager["Task"]):
    """One step of known size; :meth:`advance` as parts of it are done. Does nothing itself."""

    def advance(self, n: int) -> None:
        """``n`` more units (bytes) are done."""

    def close(self) -> None:
        """The step is over (done, or abandoned by an exception)."""

    def __exit__(self, *exc: object) -> None:
        self.close()


class Progress(Protocol):
    def task(self, label: str, total: int) -> Task:
        """A step of ``total`` bytes, named for a person (``rebuild v7 from v5``)."""
        ...


class _Silent:
    def task(self, label: str, total: int) -> Task:
        return Task()


#: Shows nothing: library code's default.
SILENT: Progress = _Silent()


class _Bar(Task):
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def advance(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class _Terminal:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def task(self, label: str, total: int) -> Task:
        from tqdm import tqdm

        # bytes in KiB/MiB/GiB with a rate and time left; redrawn at most 5 times a second, so
        # hashing at GB/s spends nothing measurable on the bar (bench/progress_overhead.py: a
        # 256 MiB rebuild took 0.90x as long with the bar as without, within its noise)
        return _Bar(tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                         file=self.stream, mininterval=0.2, dynamic_ncols=True, leave=True))


def for_terminal(stream: IO[str] | None = None) -> Progress:
    """Bars on ``stream`` (stderr) when it is a terminal, else :data:`SILENT`."""
    stream = stream or sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed, or no stream at all
        tty = False
    return _Terminal(stream) if tty else SILENT


def quiet_library_bars() -> None:
    """Turn off the bars transformers and huggingface_hub draw on their own (loading and saving
    weights), which they draw on stderr whether it is a terminal or not: a command that is not
    on a terminal shows none (call it only then)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


def is_terminal(stream: IO[str] | None = None) -> bool:
    return for_terminal(stream) is not SILENT


__all__ = ["SILENT", "Progress", "Task", "for_terminal", "is_terminal", "quiet_library_bars"]
