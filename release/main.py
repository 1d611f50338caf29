"""Entrypoint of the release controller: ``flywheel release serve``.

Runs the controller loop (release/controller.py) and, in the same process, the REST API and web
console (release/api.py, release/console.py) on ``release.host:release.port`` (8100 by default,
``FLYWHEEL_RELEASE_PORT``). State lives in ``FLYWHEEL_DATABASE_URL`` (PostgreSQL) or an SQLite
file under ``<data_dir>/release/``. Several processes may run against one database: one holds the
lease and acts, the others serve the API and stand by. SIGTERM or Ctrl-C stops it; ``kill -9`` is
safe (release/store.py).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from flywheel.metrics import new_registry
from flywheel.settings import HttpSettings, Settings
from flywheel.stream.serve import stop_on_signals

if TYPE_CHECKING:
    from release.store import ReleaseStore

log = logging.getLogger(__name__)


class ApiServer:
    """uvicorn on a thread of its own; ``port`` is known once :meth:`start` returns."""

    def __init__(self, app: Any, host: str, port: int, limits: HttpSettings | None = None,
                 registry: Any = None) -> None:
        import uvicorn

        from flywheel.connections import ConnectionGuard, server_config

        # slow and greedy clients are cut as serving's are (``http`` settings, flywheel/connections.py)
        limits = limits if limits is not None else HttpSettings()
        self.guard = ConnectionGuard(limits)
        if registry is not None:
            self.guard.count_in(registry, "release")
        self.server = uvicorn.Server(server_config(app, host, port, limits, self.guard))
        self.thread = threading.Thread(target=self.server.run, name="release-api", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the release API did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)


def run(settings: Settings, args: argparse.Namespace | None = None, stop: Any = None) -> int:
    """Serve until SIGTERM/SIGINT, or until ``stop.is_set()`` when a stop flag is given."""
    from flywheel.checkpoints import open_store
    from flywheel.connections import raise_open_files
    from flywheel.probes import Heartbeat, alive
    from release.api import make_app
    from release.auth import parse_tokens
    from release.controller import Controller
    from release.streams import Streams
    from release.webhooks import Webhooks

    cfg = settings.release
    parse_tokens(cfg.tokens)  # a malformed token entry stops the start, with the reason
    raise_open_files(settings.http)  # the connection cap needs its files (logged; warns if short)
    stop = stop if stop is not None else stop_on_signals()
    with ExitStack() as held:  # released in reverse on any exit, a refused start included
        # the API gets a connection of its own: one connection is not for two threads' transactions
        stores = _until_the_database_works(settings, stop)
        if stores is None:
            return 0  # stopped while waiting
        store, api_store = stores
        held.callback(store.close)
        held.callback(api_store.close)
        # one registry for the process: the API's /metrics shows the streams' dead letters too
        registry = new_registry()
        streams = Streams(settings, registry)
        held.callback(streams.close)
        controller = Controller(settings, store, streams, open_store(settings), registry)
        # every decision sent to the configured webhooks, whichever of the two stores made it
        webhooks = (Webhooks(cfg.webhooks, cfg.deployment, registry, attempts=cfg.webhook_attempts,
                             backoff_s=cfg.webhook_backoff_s, allow_internal=cfg.webhook_allow_internal)
                    if cfg.webhooks else None)
        if webhooks is not None:
            held.callback(webhooks.close)
        heartbeat = Heartbeat()  # beaten when a turn starts and ends: /livez (flywheel/probes.py)
        notify = (webhooks,) if webhooks is not None else ()
        app = make_app(api_store, cfg, controller.status, registry, live=alive(heartbeat, settings.probes.hung_s),
                       verify=controller.verify, notify=notify)
        store.listeners.extend((app.state.decisions, *notify))  # the loop's own decisions, counted and sent alike
        api = ApiServer(app, cfg.host, cfg.port, settings.http, registry).start()
        held.callback(api.stop)
        log.info("release controller %s: API and console on http://%s:%d/", controller.holder, cfg.host, api.port)
        # the gate's model libraries take seconds to import on a busy machine: import them now,
        # not between the first checkpoint and its canary (where it was most of that wait)
        threading.Thread(target=_import_gate_libraries, name="release-warm", daemon=True).start()
        while not stop.is_set():
            heartbeat.beat()
            try:
                controller.tick()
            except Exception:  # a turn that fails is logged and retried: the store is consistent
                log.exception("a controller turn failed; retrying")
            heartbeat.beat()
            stop.wait(cfg.tick_s) if hasattr(stop, "wait") else time.sleep(cfg.tick_s)
    return 0


def _until_the_database_works(settings: Settings, stop: Any) -> tuple[ReleaseStore, ReleaseStore] | None:
    """The controller's store and the API's, opened (their tables made) once the release database
    takes writes: a controller started during a failover (read-only, or not answering) waits for
    it, as a stream stage does (flywheel/stream/serve.py), with one log line per kind of error,
    instead of exiting with a traceback to be restarted in a loop. Meanwhile its port answers
    ``/livez`` 200 and ``/readyz`` 503 (``waiting for the release database``), so the kubelet
    neither restarts it nor sends it traffic. A refused login exits 77 naming
    ``release.database_url``. None: stopped first."""
    from flywheel.metrics import serve_ops
    from flywheel.probes import Probes
    from flywheel.stream.serve import until_the_database_works
    from release.store import ReleaseStore, database_url

    url, cfg = database_url(settings.release.database_url, settings.data_dir), settings.release
    waiting: dict[str, object] = {"starting": "waiting for the release database"}
    ops = serve_ops(new_registry(), Probes(live=lambda: (True, waiting), ready=lambda: (False, waiting)),
                    cfg.host, cfg.port)
    try:
        return until_the_database_works(lambda: (ReleaseStore(url), ReleaseStore(url)), url, stop, "release",
                                        setting="release.database_url")
    finally:  # the API takes the port over
        ops.shutdown()
        ops.server_close()


def _import_gate_libraries() -> None:
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401 - the lazy module behind it
    except Exception:
        log.debug("warming the gate's imports failed", exc_info=True)
