"""Test-only crash points for the stage subprocesses of tests/integration/test_pipeline_exactly_once.py.

A test puts this folder first on a child's ``PYTHONPATH``; Python imports ``sitecustomize`` at
start-up. With ``FLYWHEEL_TEST_CRASH_AT`` set to one of :data:`POINTS` (``point`` or ``point:N``,
the N-th time the process gets there; the first by default) the process SIGKILLs itself at that
moment of the delivery protocol (flywheel/stream/store.py, flywheel/stream/outbox.py); without it
nothing changes.

- ``committed``: ``Outbox.deliver`` with rows owed and none in flight or failing: a batch's
  transaction committed its outputs, none of them was sent yet (the restart must send them; no
  repeat can come of it).
- ``delivered``: a ``StateStore.delivered`` call with rows: Kafka acked their sends, the outbox
  has not deleted them yet (the restart sends them again: repeats the readers drop by key).
- ``resent``: the first ``StateStore.delivered`` call acking a row the outbox already held when
  the process started: a restart dies while sending again what the last crash left.
- ``archived``: a ``StateStore.archived`` call: the archive files are renamed into place, the
  queue still holds their rows (the restart must find them in the files).

Just before the kill the process writes :data:`MARK` to stderr (the stage's log) with the point,
its pid and how many of the outbox's rows may already be on their topics, at least and at most
(``landed A..B``): the test bounds the repeats on the output topics with them.

The variable is taken out of the environment here: the stage's settings refuse unknown
``FLYWHEEL_*`` names. Nothing of the project is imported here: this runs before ``sys.path``
holds the working directory (``python -m``), so an import now could resolve ``flywheel`` to
another checkout (the editable install's). Instead an import hook patches the point's module
right after the program itself imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys

ENV = "FLYWHEEL_TEST_CRASH_AT"
#: Crash point -> the module it patches.
POINTS = {
    "committed": "flywheel.stream.outbox",
    "delivered": "flywheel.stream.store",
    "resent": "flywheel.stream.store",
    "archived": "flywheel.stream.store",
}
#: Written to stderr (the stage's log) just before the kill: the test checks the process died here.
MARK = "crashpoint: SIGKILL at"


def _die(point: str, landed: tuple[int, int]) -> None:
    sys.stderr.write(f"{MARK} {point} (pid {os.getpid()}; landed {landed[0]}..{landed[1]})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(module, point: str, nth: int) -> None:
    calls = 0

    def arrive(landed: tuple[int, int]) -> None:
        nonlocal calls
        calls += 1
        if calls >= nth:
            _die(point, landed)

    if point == "committed":
        deliver = module.Outbox.deliver

        def crashing_deliver(self, shards, wait=False):
            shards = list(shards)  # (an iterable: read it once)
            if self.store.owed and not self._in_flight and not self._failing:
                # every owed row was stored and never sent: none of them is on a topic
                arrive((0, 0))
            return deliver(self, shards, wait)

        module.Outbox.deliver = crashing_deliver
    elif point == "delivered":
        delivered = module.StateStore.delivered

        def crashing_delivered(self, seqs):
            seqs = list(seqs)
            if seqs:  # rows acked by Kafka, about to leave the outbox; any other owed row may have landed
                arrive((len(set(seqs)), self.owed))
            return delivered(self, seqs)

        module.StateStore.delivered = crashing_delivered
    elif point == "resent":
        init, delivered = module.StateStore.__init__, module.StateStore.delivered

        def noting_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            row = self.db.execute("SELECT max(seq) FROM outbox").fetchone()
            self._crashpoint_leftover = row[0] if row and row[0] is not None else 0

        def crashing_delivered(self, seqs):
            seqs = list(seqs)
            if any(s <= self._crashpoint_leftover for s in seqs):  # acks of rows sent again
                arrive((len(set(seqs)), self.owed))
            return delivered(self, seqs)

        module.StateStore.__init__ = noting_init
        module.StateStore.delivered = crashing_delivered
    elif point == "archived":
        archived = module.StateStore.archived

        def crashing_archived(self, firsts):
            arrive((0, self.owed))
            return archived(self, firsts)

        module.StateStore.archived = crashing_archived


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
        if fullname != POINTS[self.point]:
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
        sys.stderr.write(f"{ENV}={value!r}: expected one of {sorted(POINTS)}, optionally with :N (N >= 1)\n")
        sys.stderr.flush()
        os._exit(2)
    sys.meta_path.insert(0, _Hook(point, int(nth or 1)))


_install()
