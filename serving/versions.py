"""The engines serving runs, the version each holds, and which route each answers.

A :class:`Fleet` has one slot per engine (``serve.engines``, 1 or 2). Every request asks
:meth:`Fleet.pick` for a slot: by the version it pinned (``flywheel@v12``), else by its user's
arm (:func:`serving.routing.arm_of`). :meth:`Fleet.apply` moves the slots to a new release by
the steps :func:`serving.routing.plan` gives: a routing change is one assignment on the event
loop, so a request sees the old routing or the new one, never half of each; a load pauses only
the slot it reloads. With adapter versions (``serve.lora``) both slots are views of one engine
(serving/adapters.py) and a load is an adapter added to it, which pauses nothing.

Everything here runs on the serving event loop (vLLM's ``AsyncLLM`` is bound to it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serving.engine import Engine, GenRequest
from serving.engine_stats import FleetStatsCollector
from serving.routing import Routing, Step, Want, arm_of, plan

log = logging.getLogger(__name__)


@dataclass
class Slot:
    index: int
    engine: Engine
    #: Requests running on this slot now (for the in-flight-during-swap metric and draining).
    in_flight: int = 0
    loading: bool = False

    @property
    def version(self) -> int:
        return self.engine.model_version


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry, fleet: Fleet) -> None:
        self.swaps = Counter("serving_swaps_total", "Weight loads into a running engine, by outcome",
                             ["outcome"], registry=registry)
        for outcome in ("ok", "failed"):
            self.swaps.labels(outcome)
        self.swap_seconds = Histogram("serving_swap_seconds", "Time requests on the reloaded engine were paused",
                                      registry=registry, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.in_flight_at_swap = Histogram("serving_swap_requests_in_flight",
                                           "Requests running on an engine when its weights were swapped",
                                           registry=registry, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.routed = Counter("serving_routed_requests_total", "Requests by the route that answered them",
                              ["route"], registry=registry)
        for route in ("stable", "canary", "pinned"):
            self.routed.labels(route)
        routes = Gauge("serving_route_version", "Version each route serves (-1: the route is off)",
                       ["route"], registry=registry)
        routes.labels("stable").set_function(lambda: fleet.version_of("stable"))
        routes.labels("canary").set_function(lambda: fleet.version_of("canary"))
        Gauge("serving_canary_share", "Share of users the canary route answers",
              registry=registry).set_function(lambda: fleet.routing.share if fleet.routing.canary is not None else 0.0)
        # vLLM's statistics of each engine (serving/engine_stats.py), labelled by slot at scrape
        registry.register(FleetStatsCollector([slot.engine for slot in fleet.slots]))


class Fleet:
    """The slots and the routing; see the module docstring."""

    def __init__(self, engines: list[Engine], registry: CollectorRegistry | None = None) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.routing = Routing(stable=0)
        self._lock = asyncio.Lock()  # one release applied at a time
        self.metrics = FleetMetrics(registry, self) if registry is not None else None

    # -- what requests use ---------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.slots[0].engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(s.engine.max_model_len for s in self.slots)

    @property
    def logprobs_mode(self) -> str:
        return self.slots[0].engine.logprobs_mode

    def pick(self, user_id: str, pinned: int | None = None) -> tuple[Slot, str]:
        """The slot a request runs on and its route (``stable``, ``canary`` or ``pinned``).
        Raises LookupError for a pinned version no slot serves."""
        r = self.routing
        if pinned is not None:
            for i in (r.stable, r.canary):
                if i is not None and self.slots[i].version == pinned:
                    return self._count(self.slots[i], "pinned")
            raise LookupError(pinned)
        if r.canary is not None and arm_of(user_id, r.share, r.salt) == "canary":
            return self._count(self.slots[r.canary], "canary")
        return self._count(self.slots[r.stable], "stable")

    def _count(self, slot: Slot, route: str) -> tuple[Slot, str]:
        if self.metrics is not None:
            self.metrics.routed.labels(route).inc()
        return slot, route

    def served_versions(self) -> dict[str, int]:
        """``{"stable": v, "canary": w}`` (no ``canary`` while none runs)."""
        out = {"stable": self.slots[self.routing.stable].version}
        if self.routing.canary is not None:
            out["canary"] = self.slots[self.routing.canary].version
        return out

    def version_of(self, route: str) -> int:
        return self.served_versions().get(route, -1)

    def healthy(self) -> bool:
        return all(s.engine.healthy() for s in self.slots)

    def resident_versions(self) -> set[int]:
        """Versions whose files an engine may still read: those the slots hold, and on the adapter
        engine those replaced while requests still run on them (serving/adapters.py)."""
        held = {s.version for s in self.slots}
        for s in self.slots:
            held |= getattr(s.engine, "resident_versions", lambda: set())()
        return held

    # -- following releases --------------------------------------------------------------------
    def steps_for(self, want: Want) -> list[Step]:
        return plan([s.version for s in self.slots], self.routing, want)

    async def apply(self, steps: list[Step], dirs: dict[int, Path]) -> dict[str, float]:
        """Carry out ``steps`` (from :meth:`steps_for`); ``dirs`` maps each version to load to its
        verified directory. Returns the pause of each load, by ``v<version>``."""
        paused: dict[str, float] = {}
        async with self._lock:
            for step in steps:
                self.routing = step.routing
                if step.load is None:
                    continue
                slot, version = self.slots[step.load[0]], step.load[1]
                paused[f"v{version}"] = await self._load(slot, dirs[version], version)
                if step.routing.role_of(slot.index) is None:
                    await self._warm(slot)  # before any user is routed to it
        return paused

    async def _warm(self, slot: Slot) -> None:
        """A few short generations on an engine that just loaded while idle: the first batches of
        a fresh engine are several times slower (measured: a canary's p95 latency 8x stable's in
        its first seconds, which its latency guardrail judged as a regression)."""
        ids = list(self.tokenizer.encode("warm up", add_special_tokens=True)) or [0]
        req = GenRequest(prompt_token_ids=ids, max_tokens=8, temperature=1.0)
        try:
            await asyncio.gather(*(slot.engine.complete(req, f"warmup-{uuid.uuid4().hex}") for _ in range(4)))
        except Exception as exc:  # noqa: BLE001 - a warm-up is a courtesy: the swap itself succeeded
            log.warning("slot %d: warm-up failed: %r", slot.index, exc)

    async def _load(self, slot: Slot, directory: Path, version: int) -> float:
        before = slot.version
        slot.loading = True
        m = self.metrics
        if m is not None:
            m.in_flight_at_swap.observe(slot.in_flight)
        t0 = time.perf_counter()
        try:
            pause = await slot.engine.reload(directory, version)
        except BaseException:
            if m is not None:
                m.swaps.labels("failed").inc()
            raise
        finally:
            slot.loading = False
        if m is not None:
            m.swaps.labels("ok").inc()
            m.swap_seconds.observe(pause)
        log.info("slot %d: v%d -> v%d in %.0f ms (requests paused %.0f ms, %d in flight)", slot.index, before,
                 version, (time.perf_counter() - t0) * 1e3, pause * 1e3, slot.in_flight)
        return pause
