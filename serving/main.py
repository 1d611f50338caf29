"""``flywheel serve``: verify the weights, start the engine and the API, stop cleanly on SIGTERM.

    openssl rand -hex 32 > salt    # serve.user_id_salt: refused at its published default or short, beside API keys
    FLYWHEEL_MODEL_DIR=data/model FLYWHEEL_API_KEYS=sk-local FLYWHEEL_SERVE_USER_ID_SALT_FILE=salt flywheel serve

Start-up order: the model directory is checked against its manifest (unverified weights are never
served), the topics are created if missing, the recorder starts and replays any journal a previous
process left under ``<data_dir>/serving/journal``, the engines start (``serve.engines``; with
adapter versions, ``serve.lora``, one engine of the model directory: serving/adapters.py), the newest
release for ``release.deployment`` is fetched, verified and loaded (serving/follow.py), and only
then uvicorn opens ``serve.host:serve.port``; ``/livez`` answers from then on, ``/readyz`` once
every engine has answered a warm-up (serving/readiness.py) and a routing is applied (with no release
on the topic, a wait of up to ``serve.routing_wait_s`` for the controller's). SIGTERM/SIGINT stop the server: its
port closes, ``/readyz`` says draining, and in-flight requests (streams included) finish for up
to ``serve.drain_s``; then the release follower stops, the recorder delivers or journals
everything queued, and the engines shut down. Kubernetes' grace period covers all of it
(deploy/k8s/base/serving.yaml).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from flywheel.checkpoints import ManifestError, verify_dir
from flywheel.connections import raise_open_files
from flywheel.contracts import Topics
from flywheel.extras import require_vllm
from flywheel.kafka.topics import ensure_declared
from flywheel.metrics import new_registry, serve_ops
from flywheel.probes import Probes
from flywheel.settings import ServeSettings, Settings, SettingsError
from flywheel.signing import Verifier
from flywheel.telemetry import Tracing
from flywheel.topology import Role, role_topics
from serving.adapters import adapter_slots, lora_on
from serving.follow import ReleaseFollower
from serving.journal import Journal
from serving.recorder import Recorder
from serving.versions import Fleet

if TYPE_CHECKING:
    from serving.readiness import Readiness

log = logging.getLogger("serving")


def journal_dir(settings: Settings) -> Path:
    return Path(settings.data_dir) / "serving" / "journal"


def metrics_server(settings: Settings, registry: CollectorRegistry, readiness: Readiness,
                   fleet: Fleet) -> ThreadingHTTPServer | None:
    """``serve.metrics_port``: ``/metrics`` on a port of its own, served as the stages' ops port is
    (slow clients cut, connections capped: flywheel/metrics.py), its ``/livez`` and ``/readyz``
    answering as the API's; the API port then answers ``/metrics`` 404 (serving/app.py). None
    when unset. A daemon thread: it ends with the process."""
    if settings.serve.metrics_port is None:
        return None

    def ready() -> tuple[bool, dict[str, object]]:
        not_ready = readiness.check(fleet)
        return not_ready is None, {} if not_ready is None else {"reason": not_ready.value}

    server = serve_ops(registry, Probes(live=lambda: (True, {}), ready=ready), settings.serve.host,
                       settings.serve.metrics_port)
    log.info("metrics on %s:%d/metrics", settings.serve.host, server.server_port)
    return server


def make_recorder(settings: Settings, registry: CollectorRegistry) -> Recorder:
    journal = Journal(journal_dir(settings), settings.serve.journal_max_bytes)
    if journal.truncated_bytes:
        log.warning("journal had a torn tail of %d bytes (crash mid-write); truncated", journal.truncated_bytes)
    return Recorder(settings.kafka, journal, registry, ack_timeout_s=settings.serve.ack_timeout_s,
                    queue_max=settings.serve.publish_queue_max).start()


#: The shortest ``serve.user_id_salt`` serving takes beside API keys. The salt is the HMAC key of
#: every key id serving publishes, so a guessed salt gives the keys away as the published one does.
#: One Python core checked 7*10^4 salts a second (flywheel/apikeys.py ``key_id``); a GPU running
#: HMAC-SHA256 does on the order of 10^9: 8 lowercase letters (2*10^11) fall in minutes there, 16
#: hex digits (64 bits) take centuries. Length proves no randomness, but it turns away placeholders
#: ("", "x", "changeme") and single words.
MIN_SALT_CHARS = 16

_HOW_TO_SET = ("Set a long random secret of your own, the same on every serving replica and kept for good (a new "
               "one gives every user and key a new id): FLYWHEEL_SERVE_USER_ID_SALT_FILE=<file holding it> (or "
               "FLYWHEEL_SERVE_USER_ID_SALT), e.g. from `openssl rand -hex 32` (docs/deploy.md, Secrets)")


def salt_refusal(serve: ServeSettings) -> str | None:
    """Why serving may not start on ``serve.user_id_salt``, or None. With API keys and the
    published default salt, or one shorter than :data:`MIN_SALT_CHARS`, an API key id (in every
    generation record, the archive and, with ``serve.metrics_key_ids``, ``/metrics``) gives the key
    away to anyone who hashes guesses: a short key fell to 10^4 guesses in 0.01 s. ``flywheel up``
    and ``flywheel demo`` set a random salt of their own (local/up.py ``local_salt``, 64 hex
    digits), so only a hand-made deployment meets this."""
    if not serve.api_keys:
        return None
    if serve.uses_default_salt:
        return ("serve.user_id_salt is the published default while serve.api_keys are set: anyone can check a "
                f"guessed API key against the key ids serving publishes. {_HOW_TO_SET}")
    if len(serve.user_id_salt) < MIN_SALT_CHARS:
        return (f"serve.user_id_salt is {len(serve.user_id_salt)} characters long while serve.api_keys are set; it "
                f"needs at least {MIN_SALT_CHARS}: a short salt is guessed, and with it every API key from the key "
                f"ids serving publishes. {_HOW_TO_SET}")
    return None


def routing_secret_refusal(settings: Settings) -> str | None:
    """Why serving may not split users on ``routing_secret``, or None. With API keys (product
    users to protect) and releases followed (a canary may split them), a secret that is empty or
    shorter than :data:`MIN_SALT_CHARS` lets whoever reads the releases topic, or guesses it,
    compute every user's arm (serving/arms.py). ``flywheel up`` and ``flywheel demo`` make one."""
    if not settings.serve.api_keys or not settings.serve.follow_releases:
        return None
    if len(settings.routing_secret) >= MIN_SALT_CHARS:
        return None
    how = "is not set" if not settings.routing_secret else f"is {len(settings.routing_secret)} characters long"
    return (f"routing_secret {how} while serve.api_keys are set: the canary split would be computable from the "
            f"releases topic. Set a random secret of at least {MIN_SALT_CHARS} characters, the same for serving "
            "and the release controller: FLYWHEEL_ROUTING_SECRET_FILE=<file holding it> (or "
            "FLYWHEEL_ROUTING_SECRET), e.g. from `openssl rand -hex 32` (docs/deploy.md, Secrets)")


def run(settings: Settings, args: argparse.Namespace | None = None) -> int:
    # an install without vLLM's extra says so before anything starts, not as an ImportError once
    # the recorder and the journal are up
    require_vllm()
    refusal = salt_refusal(settings.serve) or routing_secret_refusal(settings)
    if refusal is not None:  # a setting to fix: said before the model is read (exit 2)
        raise SettingsError(refusal)
    from serving.app import create_app
    from serving.engine import VllmEngine
    from serving.readiness import Readiness, warm_up
    from serving.server import AppServer, LoopThread

    try:
        manifest = verify_dir(settings.model_dir)
    except ManifestError as exc:
        log.error("refusing to serve: %s", exc)
        return 2
    log.info("model %s verified (version %s)", settings.model_dir, manifest["version"])
    raise_open_files(settings.http)  # the connection cap needs its files (logged; warns if short)
    if settings.serve.uses_default_salt:  # no keys: only the pseudonyms are at stake
        log.warning("serve.user_id_salt is the built-in default: anyone can compute the user pseudonyms serving "
                    "records; set FLYWHEEL_SERVE_USER_ID_SALT (or its _FILE) to a secret of your own before real "
                    "users arrive, and keep it")
    verifier = None
    if settings.serve.follow_releases:
        # trusted keys none of which can be used stop the start now (KeyFileError: exit 2 with the
        # reasons), not once the engines have loaded, minutes on a GPU, on every restart of a crash
        # loop; a bad file beside a good key is refused and logged here, once, and the follower
        # goes on with this verifier
        verifier = Verifier.load(settings.serve.trusted_release_keys, setting="serve.trusted_release_keys")
    topics = Topics(settings.topic_prefix)
    try:
        # its own topics, as flywheel/topology.py declares them (so a serving pod that starts
        # first makes the same topics as the others would)
        ensure_declared(settings.kafka, topics, role_topics(Role.SERVING))
    except Exception as exc:  # noqa: BLE001 - serving still starts: events wait in the journal for the broker
        log.warning("could not ensure topics (%r); events will be journaled until the broker is back", exc)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    registry = new_registry()
    recorder = make_recorder(settings, registry)
    tracing = Tracing(settings.telemetry, "serving")
    loop = LoopThread()
    engines: list = []
    follower = None
    try:
        if lora_on(settings):  # one engine; stable and canary are adapters on it
            engines.append(loop.call(lambda: _engine(VllmEngine, settings, lora=True)))
            fleet = Fleet(adapter_slots(engines[0], settings.model_dir), registry)
        else:
            for _ in range(settings.serve.engines):
                engines.append(loop.call(lambda: _engine(VllmEngine, settings)))
            fleet = Fleet(engines, registry)
        if settings.serve.follow_releases:
            follower = ReleaseFollower(settings, fleet, lambda fn: loop.call(fn, timeout_s=600), registry,
                                       verifier=verifier)
            follower.catch_up(settings.serve.release_wait_s)  # before the port opens
            follower.start()
        # with releases followed, not ready while no routing is applied (serve.routing_wait_s)
        readiness = Readiness(routing=follower.routing if follower is not None else None)
        app = create_app(settings, fleet, recorder, registry, follower, readiness, tracing)
        server = AppServer(app, loop, settings.serve.host, settings.serve.port, drain_s=settings.serve.drain_s,
                           limits=settings.http, registry=registry).start()
        metrics_server(settings, registry, readiness, fleet)
        log.info("serving %s %s on %s; warming the engines up", settings.serve.model_name,
                 fleet.served_versions(), server.url)
        loop.call(lambda: warm_up(fleet), timeout_s=600)
        readiness.warm = True
        log.info("ready: /readyz answers 200")
        stop.wait()
        readiness.draining = True
        log.info("stopping: draining requests for up to %.0fs, then flushing the publisher", settings.serve.drain_s)
        server.stop()
    finally:
        if follower is not None:
            follower.stop()
        recorder.stop()
        tracing.shutdown()
        for engine in engines:
            loop.call(lambda e=engine: _shutdown(e), timeout_s=60)
        loop.stop()
    return 0


async def _engine(cls: type, settings: Settings, lora: bool = False):  # built on the loop that will serve it
    return cls(settings.serve, settings.model_dir, lora)


async def _shutdown(engine) -> None:  # and shut down there, beside its output handler
    engine.shutdown()
