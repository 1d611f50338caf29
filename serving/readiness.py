"""Whether serving takes traffic (``GET /readyz``), and the warm-up that makes it ready.

``flywheel serve`` opens its port once its engines are loaded and the release it follows is
applied, but an engine's first requests are slow: in a fresh ``make demo`` the first 20 s of
requests after serving answered waited up to 19 s each, while the engines ran their first
forward passes. So serving is ready only once every engine has answered a warm-up
(:func:`warm_up`): a few short generations straight on the engine, never through the API, so no
generation is recorded and no canary counts them. It stops being ready when SIGTERM starts the
drain (serving/main.py) or an engine dies; ``/livez`` fails only on a dead engine, which a
restart mends.

A serving that follows releases is not ready either while it has applied no routing, for up to
``serve.routing_wait_s`` (:func:`judge_routing`): a pod whose emptyDir lost its saved release,
started when retention had left no record on the releases topic, would otherwise take traffic on
the bare model directory while the controller routes users to v12. The controller sends its
routing again at its start and every ``release.reannounce_s`` (release/controller.py), which ends
the wait. Past the wait it serves the model directory anyway, marked ``unconfirmed``: a controller
that is down must not take serving down with it, and the mark pages nobody silently (an error in
the log, ``serving_release_routing_unconfirmed`` on ``/metrics``, ``releases.routing`` on ``/health``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from enum import Enum

from serving.engine import GenRequest
from serving.versions import Fleet

log = logging.getLogger(__name__)

#: Concurrent warm-up requests per engine and their tokens: a batch of several sequences, streamed
#: and not, so the first product requests find the batched paths run once too.
WARM_REQUESTS = 4
WARM_TOKENS = 8


class NotReady(Enum):
    """Why ``/readyz`` answers 503 (its ``reason``)."""

    WARMING = "warming up: the engines have not answered their warm-up yet"
    DRAINING = "draining: stopping, in-flight requests are finishing"
    ENGINE_DEAD = "an engine is dead"
    NO_ROUTING = ("no routing yet: waiting for the release controller's routing on the releases topic "
                  "(serve.routing_wait_s)")


class RoutingState(Enum):
    """Whether serving runs a routing the release controller decided (``releases.routing`` on ``/health``)."""

    APPLIED = "applied"  # a release applied, from the topic or the one saved under data_dir
    WAITING = "waiting"  # none yet, within serve.routing_wait_s: not ready
    UNCONFIRMED = "unconfirmed"  # none after the wait: the model directory served, loudly


def judge_routing(applied: bool, waited_s: float, wait_s: float) -> RoutingState:
    """Pure: a routing applied, or how the wait for one stands after ``waited_s`` of ``wait_s``."""
    if applied:
        return RoutingState.APPLIED
    return RoutingState.WAITING if waited_s < wait_s else RoutingState.UNCONFIRMED


class Readiness:
    """Serving's readiness, set by ``flywheel serve`` and read by ``/readyz``. ``routing``: the
    release follower's :class:`RoutingState` (None: releases not followed, nothing to wait for)."""

    def __init__(self, warm: bool = False, routing: Callable[[], RoutingState] | None = None) -> None:
        self.warm = warm
        self.draining = False
        self.routing = routing

    def check(self, fleet: Fleet) -> NotReady | None:
        """None when ready, else the reason it is not."""
        if not fleet.healthy():
            return NotReady.ENGINE_DEAD
        if self.draining:
            return NotReady.DRAINING
        if not self.warm:
            return NotReady.WARMING
        if self.routing is not None and self.routing() is RoutingState.WAITING:
            return NotReady.NO_ROUTING
        return None


async def warm_up(fleet: Fleet) -> float:
    """Run :data:`WARM_REQUESTS` short generations on every engine at once; the seconds taken.

    Raises what an engine raises: a start whose engine cannot generate fails, not a ready pod."""
    t0 = time.perf_counter()
    prompt = fleet.tokenizer.encode("Hello, how are you today?")[: max(1, fleet.max_model_len - WARM_TOKENS)]
    req = GenRequest(prompt_token_ids=prompt or [0], max_tokens=WARM_TOKENS, temperature=1.0, seed=0)

    async def streamed(engine, rid: str) -> None:
        async for _ in engine.stream(req, rid):
            pass

    calls = []
    for slot in fleet.slots:
        for i in range(WARM_REQUESTS):
            rid = f"warmup-{slot.index}-{i}-{uuid.uuid4().hex[:8]}"
            calls.append(streamed(slot.engine, rid) if i % 2 else slot.engine.complete(req, rid))
    await asyncio.gather(*calls)
    took = time.perf_counter() - t0
    log.info("engines warmed up in %.1fs (%d requests of %d tokens each)", took, len(calls), WARM_TOKENS)
    return took
