"""Run the app on an event loop in a background thread (tests, benchmark, ``flywheel serve``).

vLLM's ``AsyncLLM`` binds to the event loop it is first used on, so one :class:`LoopThread`
owns the engine and every uvicorn server that uses it; tests start one loop and one engine per
session and any number of short-lived apps on it, each on its own loopback port.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from prometheus_client import CollectorRegistry

from flywheel.connections import ConnectionGuard, server_config
from flywheel.settings import HttpSettings

T = TypeVar("T")


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (vLLM's server uses it too): cheaper per task switch and socket op."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An asyncio loop running forever on a daemon thread; ``call`` runs a coroutine on it."""

    def __init__(self, name: str = "serving-loop") -> None:
        self.loop = new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(_wrap(fn), self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _wrap(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


class AppServer:
    """A uvicorn server for ``app`` on ``loop``; ``port`` is known once :meth:`start` returns."""

    def __init__(self, app: Any, loop: LoopThread, host: str = "127.0.0.1", port: int = 0,
                 drain_s: float = 5.0, limits: HttpSettings | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        # On stop uvicorn closes its listening socket first (a new connection is refused, a kept
        # alive one is closed once its response ends), then lets the requests in flight finish for
        # up to drain_s (``serve.drain_s``) and cancels what is left. Slow and greedy clients are
        # cut by the guard (``http`` settings, flywheel/connections.py), counted in ``registry``.
        limits = limits if limits is not None else HttpSettings()
        self.guard = ConnectionGuard(limits)
        if registry is not None:
            self.guard.count_in(registry, "serving")
        config = server_config(app, host, port, limits, self.guard, timeout_graceful_shutdown=drain_s)
        self.server = uvicorn.Server(config)
        self.drain_s = drain_s
        self.loop = loop
        self._done: Any = None

    def start(self, timeout_s: float = 30.0) -> AppServer:
        self._done = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop.loop)
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self._done.done():
                self._done.result()  # raises the bind error
                raise RuntimeError("server exited during start")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and drain (see ``__init__``); returns once the server has stopped,
        or ``timeout_s`` (default: the drain and 5 s) has passed."""
        self.server.should_exit = True
        if self._done is not None:
            try:
                self._done.result(self.drain_s + 5.0 if timeout_s is None else timeout_s)
            except Exception:  # noqa: BLE001, S110 - it is stopping either way; nothing left to serve
                pass
