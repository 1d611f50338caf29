"""Test-only crash points for the stage subprocesses of tests/integration/test_pipeline_exactly_once.py.

A test puts this folder first on a child's ``PYTHONPATH``; Python imports ``sitecustomize`` at
start-up. With ``FLYWHEEL_TEST_CRASH_AT`` set to one of :data:`POINTS` (``point`` or ``point:N``,
the N-th time the process gets there; the first by default) the process SIGKILLs itself at that
moment of the exactly-once protocol (ingest/exactly_once.py); without it nothing changes.

- ``mark_delivered``: a ``StateStore.mark_delivered`` call with rows: Kafka acked their sends,
  the outbox does not know yet (the restart's recovery scan must find them in the topic).
- ``archived``: a ``StateStore.archived`` call: the archive files are renamed into place, the
  queue still holds their rows (the restart must find them in the files).
- ``scan``: ``Outbox._scan``, the recovery scan itself (a restart dies while recovering).

The variable is taken out of the environment here: the stage's settings refuse unknown
``FLYWHEEL_*`` names. Nothing of the project is imported here: this runs before ``sys.path``
holds the working directory (``python -m``), so an import now could resolve ``ingest`` to another
checkout (the editable install's). Instead an import hook patches ``ingest.exactly_once`` right
after the program itself imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys

ENV = "FLYWHEEL_TEST_CRASH_AT"
TARGET = "ingest.exactly_once"
POINTS = ("mark_delivered", "archived", "scan")
#: Written to stderr (the stage's log) just before the kill: the test checks the process died here.
MARK = "crashpoint: SIGKILL at"


def _die(point: str) -> None:
    sys.stderr.write(f"{MARK} {point} (pid {os.getpid()})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(module, point: str, nth: int) -> None:
    calls = 0

    def arrive() -> None:
        nonlocal calls
        calls += 1
        if calls >= nth:
            _die(point)

    if point == "mark_delivered":
        mark_delivered = module.StateStore.mark_delivered

        def crashing_mark_delivered(self, seqs, marks):
            seqs = list(seqs)  # (an iterable: read it once)
            if seqs:  # rows acked by Kafka, about to leave the outbox
                arrive()
            return mark_delivered(self, seqs, marks)

        module.StateStore.mark_delivered = crashing_mark_delivered
    elif point == "archived":
        archived = module.StateStore.archived

        def crashing_archived(self, firsts):
            arrive()
            return archived(self, firsts)

        module.StateStore.archived = crashing_archived
    elif point == "scan":
        scan = module.Outbox._scan

        def crashing_scan(self, *args, **kwargs):
            arrive()
            return scan(self, *args, **kwargs)

        module.Outbox._scan = crashing_scan


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, point: str, nth: int) -> None:
        self.loader, self.point, self.nth = loader, point, nth

    def __getattr__(self, name):  # get_source and the like, for tracebacks
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _patch(module, self.point, self.nth)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, point: str, nth: int) -> None:
        self.point, self.nth = point, nth

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once; the regular finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.point, self.nth)
        return spec


def _install() -> None:
    value = os.environ.pop(ENV, None)
    if not value:
        return
    point, _, nth = value.partition(":")
    if point not in POINTS or not (nth or "1").isdigit() or int(nth or 1) < 1:
        sys.stderr.write(f"{ENV}={value!r}: expected one of {POINTS}, optionally with :N (N >= 1)\n")
        sys.stderr.flush()
        os._exit(2)
    sys.meta_path.insert(0, _Hook(point, int(nth or 1)))


_install()
