"""Liveness and readiness, apart: what ``/livez`` and ``/readyz`` judge for a role with a loop.

``/livez`` asks whether the process must be restarted: its loop is alive, inside a turn or between
turns. ``/readyz`` asks whether it can take traffic now: started, its consumer assigned, its
loop turning and making progress with the broker. They differ on purpose: a reward stage inside a
long labeling turn, or any stage whose broker does not answer, is alive and not ready, and a
restart would help neither (with one ``/health`` for both, a liveness probe restarted such a
reward stage in a loop). ``/health`` stays the detailed report for people.

A loop calls :meth:`Heartbeat.beat` when a turn starts and when it ends; a turn that runs longer
than ``probes.hung_s`` makes the process not alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: ``(ok, detail)``: what ``/health`` and ``/readyz`` answer, 200 when ok, else 503.
HealthFn = Callable[[], tuple[bool, dict[str, object]]]


class Heartbeat:
    """When the loop last started or finished a turn (monotonic seconds)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()

    def age_s(self) -> float:
        return time.monotonic() - self.last


@dataclass(frozen=True)
class Probes:
    """The three answers a role's ops server gives: ``live`` for ``/livez``, ``ready`` for
    ``/readyz`` and ``/health`` (which shows its detail)."""

    live: HealthFn
    ready: HealthFn


def alive(heartbeat: Heartbeat, hung_s: float) -> HealthFn:
    """``/livez`` of a loop: 200 until the loop has gone ``hung_s`` without starting or finishing
    a turn."""

    def live() -> tuple[bool, dict[str, object]]:
        age = heartbeat.age_s()
        return age < hung_s, {"turn_age_s": round(age, 3), "hung_after_s": hung_s}

    return live
