"""The trainer's wait for a checkpoint store that is out of reach (a mode taken away, a network
filesystem that does not answer): one clock and one backoff per outage.

The loop asks :meth:`StoreOutage.waiting` before it touches the store again and runs each use of
it through :meth:`StoreOutage.attempt`, which reports a failed try to :meth:`StoreOutage.failed` and
a success to :meth:`StoreOutage.ok`. The outage is logged when it starts and when it ends, never
per retry, and :meth:`StoreOutage.stalled_s` feeds ``trainer_stalled_seconds``
(dashboards/runbooks/stage-stalled.md). Which errors count as an outage is the store's call
(:meth:`flywheel.checkpoints.CheckpointStore.out_of_reach`); any other error is raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from flywheel.checkpoints import CheckpointStore

log = logging.getLogger(__name__)

#: The first retry's pause; each failed try doubles it up to :data:`MAX_PAUSE_S`. A blip of a
#: network filesystem lasts seconds, and the store is back within a pause of its return.
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 10.0
#: How long a start waits for a store out of reach before it fails, saying so. Running, the
#: trainer waits as long as it takes (``trainer_stalled_seconds`` and its alert say so); at start
#: nothing serves /metrics yet, so a store that never comes back (a wrong owner, mode or mount) must
#: end in an error, and well within the trainer's startupProbe (15 minutes,
#: deploy/k8s/base/trainer.yaml).
START_WAIT_S = 300.0

T = TypeVar("T")
#: What :meth:`StoreOutage.attempt` returns when the store was out of reach.
OUT = object()


class StoreOutOfReach(RuntimeError):
    """The checkpoint store stayed out of reach past :data:`START_WAIT_S` at start."""


class StoreOutage:
    def __init__(self, store: CheckpointStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.clock = store, clock
        self.since: float | None = None  # clock() at the outage's first failed try
        self.next_try = 0.0
        self.pause = FIRST_PAUSE_S
        self.tries = 0

    def failed(self, doing: str, exc: OSError) -> None:
        """A try failed because the store is out of reach: the next one waits a longer pause."""
        now = self.clock()
        if self.since is None:
            self.since, self.pause, self.tries = now, FIRST_PAUSE_S, 0
            # the error whole: its path may be below the root, or outside it (the model directory)
            log.warning("the checkpoint store %s is out of reach (%s: %s, while %s); the trainer waits for "
                        "it, trying again with backoff up to every %.0fs", self.store.root, type(exc).__name__,
                        exc, doing, MAX_PAUSE_S)
        else:
            self.pause = min(self.pause * 2, MAX_PAUSE_S)
            log.debug("the checkpoint store is still out of reach (%s while %s)", exc, doing)
        self.tries += 1
        self.next_try = now + self.pause

    def ok(self) -> None:
        """A try went through: an outage, if there was one, is over."""
        if self.since is not None:
            log.info("the checkpoint store is back after %.1fs (%d tries failed)", self.clock() - self.since,
                     self.tries)
            self.since = None

    def waiting(self) -> bool:
        """Whether the store is out of reach and the next try is not due yet."""
        return self.since is not None and self.clock() < self.next_try

    def wait_s(self) -> float:
        """Seconds until the next try is due (0: now)."""
        return max(0.0, self.next_try - self.clock()) if self.since is not None else 0.0

    def stalled_s(self) -> float:
        """Seconds since the store went out of reach (0 while it answers)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def attempt(self, doing: str, fn: Callable[[], T]) -> T | object:
        """``fn()``, or :data:`OUT` when the store is out of reach (a failed try); any other
        error is raised: the store is broken, not away."""
        try:
            out = fn()
        except Exception as exc:
            if (err := self.store.out_of_reach(exc)) is None:
                raise
            self.failed(doing, err)
            return OUT
        self.ok()
        return out

    def at_start(self, doing: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while the store is out of reach (:meth:`start_pause`)."""
        while (out := self.attempt(doing, fn)) is OUT:
            self.start_pause()
        return out  # type: ignore[return-value]

    def start_pause(self) -> None:
        """Sleep until the next try, or raise :class:`StoreOutOfReach` once the store has been
        out of reach :data:`START_WAIT_S`."""
        if self.stalled_s() + self.wait_s() > START_WAIT_S:
            raise StoreOutOfReach(
                f"the checkpoint store {self.store.root} has been out of reach for {self.stalled_s():.0f}s at "
                f"start: check its owner, mode and mount (a running trainer waits for it; a start waits "
                f"{START_WAIT_S:.0f}s)")
        time.sleep(self.wait_s())
