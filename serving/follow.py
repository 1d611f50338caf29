"""Serving follows ``flywheel.releases``: the newest routing for its deployment, verified, live.

Before serving opens its port, :meth:`ReleaseFollower.catch_up` reads the releases topic from
its beginning and applies the newest release for ``release.deployment``; then a thread follows
new records while serving runs. Each record is decoded and validated in one place,
:meth:`ReleaseFollower._read`. Per record:

- not signed by a key of ``serve.trusted_release_keys`` (when set) -> a dead letter (``unsigned``,
  ``bad_signature``, ``unknown_key``: flywheel/signing.py), nothing changes; whether records are
  verified at all, and how many key files were refused, shows in ``/health`` (``releases.signatures``)
  and on ``/metrics`` (``serving_release_signatures_verified``, ``serving_release_key_files_refused``);
- not a valid ``ReleaseEvent`` -> a dead letter (``invalid``, ``undecodable``...), nothing changes;
- another deployment's -> skipped (counted);
- a revision at or below the one applied (or refused) -> skipped: a repeat is a no-op, an older
  one never undoes a newer one;
- otherwise every version it needs that no engine holds is fetched from the checkpoint store
  into ``<data_dir>/serving/versions``, rebuilt from its delta chain and verified against the
  manifest hash the release carries (``flywheel.checkpoints.fetch``); then the engines load it
  and the routing flips (``serving.versions``).

A version that fails any check refuses the whole release, and so does one whose fetch fails in a
way nothing foresaw (``fetch_failed``: a URI the store's client chokes on): no record, however
made, stops serving from starting or ends the follower. Serving keeps what it serves, logs the
reason, counts it (``serving_versions_refused_total``), shows it on ``/health`` and sends a dead
letter (``stage=serving``, ``reason=version_refused``) quoting the release, where
``flywheel deadletters`` sees it.

Every release serving applies or refuses is also reported on ``flywheel.serving-status`` (a
``ServingStatusEvent``: the revision, applied or refused with the reason, the version its stable
route serves, this instance): the release controller reads it each turn and rolls back a canary
serving refused, or takes back a promotion serving refused (docs/serving-releases.md).

A store that does not answer is retried with backoff while serving keeps answering on what it
has; a newer release arriving meanwhile replaces the one being retried.

The applied release is written to ``<data_dir>/serving/release.json``: a restart that cannot
reach the broker, or finds the newest release refused, comes back on it from the local cache
(verified again) rather than on the bare model directory.

Releases are level-triggered: the controller sends its current routing again at its start and
every ``release.reannounce_s`` (a repeat here, skipped). A serving with no release applied (a new
pod whose emptyDir holds none, on a topic retention or a re-creation emptied) reports
:attr:`RoutingState.WAITING` and ``/readyz`` 503 until one arrives, for up to
``serve.routing_wait_s``; past that it serves the model directory, ``unconfirmed``, loudly
(serving/readiness.py says why).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flywheel.adapters import adapter_in
from flywheel.checkpoints import CheckpointStore, ManifestError, verify_base
from flywheel.checkpoints.fetch import (
    REFUSAL_REASONS,
    StoreUnreachable,
    VersionRefused,
    fetch_version,
    prune_cache,
)
from flywheel.checkpoints.manifest import MANIFEST_NAME, Adapter, sha256_file
from flywheel.contracts import (
    ContractError,
    ReleaseEvent,
    ServingOutcome,
    ServingStatusEvent,
    Topics,
    VersionRef,
    decode,
    encode,
)
from flywheel.kafka.clients import high_watermarks, make_consumer, make_producer, partitions_of
from flywheel.kafka.producers import KafkaSink
from flywheel.settings import Settings
from flywheel.signing import REFUSALS, SERVING_RELEASE, SignatureRefused, Verifier
from flywheel.stream.deadletters import DeadLetters
from serving.adapters import LORA_REFUSALS, Refusal, judge_version, lora_on
from serving.arms import split_salt
from serving.readiness import RoutingState, judge_routing
from serving.routing import Want, canary_unservable
from serving.versions import Fleet

log = logging.getLogger(__name__)

#: Refusal reasons besides the checkpoint fetch's own: the engines failed to load verified
#: weights, a canary was asked of a deployment with one engine, the fetch raised an error that
#: names no known cause (``http://:99999/x`` makes the HTTP client raise ValueError), or a version
#: is of a kind (adapter, full weights, another base) these engines cannot serve (serving/adapters.py).
SERVING_REFUSALS = ("load_failed", "no_canary_engine", "fetch_failed", *LORA_REFUSALS)
#: The dead-letter reason of a refused release; its detail reads "version V <reason>: <why>".
VERSION_REFUSED = "version_refused"
OUTCOMES = ("applied", "repeat", "older", "other_deployment", "invalid", "unverified", "refused")


class FollowerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.releases = Counter("serving_releases_total", "Release records read, by what serving did with them",
                                ["outcome"], registry=registry)
        self.refused = Counter("serving_versions_refused_total", "Versions refused, by reason",
                               ["reason"], registry=registry)
        self.phase = Histogram("serving_release_phase_seconds",
                               "Time from a release record to its versions answering, by phase",
                               ["phase"], registry=registry,
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.revision = Gauge("serving_release_revision", "Revision of the release applied (-1: none yet)",
                              registry=registry)
        self.revision.set(-1)
        self.unconfirmed = Gauge("serving_release_routing_unconfirmed",
                                 "1 while serving takes traffic on the model directory with no routing from the "
                                 "release controller, its wait for one (serve.routing_wait_s) over", registry=registry)
        for outcome in OUTCOMES:
            self.releases.labels(outcome)
        for reason in REFUSAL_REASONS + SERVING_REFUSALS:
            self.refused.labels(reason)


class ReleaseFollower:
    """See the module docstring. ``run_on_loop`` runs a coroutine on the engines' event loop."""

    def __init__(self, settings: Settings, fleet: Fleet, run_on_loop: Callable[[Any], Any],
                 registry: CollectorRegistry, verifier: Verifier | None = None) -> None:
        self.settings, self.fleet, self.run_on_loop = settings, fleet, run_on_loop
        self.deployment = settings.release.deployment
        self.topic = Topics(settings.topic_prefix).releases
        self.status_topic = Topics(settings.topic_prefix).serving_status
        #: Names this process in its status records: a pod's host name, and the pid beside it.
        self.instance = f"{socket.gethostname()}:{os.getpid()}"
        self.cache = CheckpointStore(Path(settings.data_dir) / "serving" / "versions")
        #: One engine of model_dir serving adapter versions (serve.lora), or full-weight engines.
        self.lora = lora_on(settings)
        #: Bases whose every file was checked against an adapter's record, by manifest hash: the
        #: engine holds the base it loaded at start, so one full check per base is enough.
        self._bases_verified: set[str] = set()
        self.state_file = Path(settings.data_dir) / "serving" / "release.json"
        self.metrics = FollowerMetrics(registry)
        # only the release controller's key may say what serving runs (flywheel/signing.py)
        # (``verifier``: the one flywheel serve loaded at start, so a refused key file is logged once)
        self.verifier = verifier if verifier is not None else Verifier.load(
            settings.serve.trusted_release_keys, setting="serve.trusted_release_keys")
        # serving_release_signatures_verified, _trusted_keys, _key_files_refused: an unverified
        # serving, or a key file it cannot use, shows on every scrape (alerts: dashboards/)
        self.verifier.register(registry, SERVING_RELEASE)
        self.applied: ReleaseEvent | None = None
        self.refused_revision = -1
        self.last_refusal: dict[str, Any] | None = None
        self.last_error: str | None = None
        #: The last release applied: its revision and the seconds each phase took.
        self.last_apply: dict[str, Any] | None = None
        self.sink = KafkaSink(lambda: make_producer(settings.kafka, "serving-deadletters", max_block_ms=5000))
        self.dead = DeadLetters(self.sink, Topics(settings.topic_prefix).deadletter, "serving", registry,
                                (VERSION_REFUSED, "invalid", "undecodable", "unknown_version", "wrong_kind", "empty",
                                 *REFUSALS))
        self._consumer: Any = None
        #: Reports held back while :meth:`catch_up` runs (None: sent as they happen).
        self._held_reports: list[tuple[Any, ...]] | None = None
        #: The newest release not applied yet because the store did not answer in time at start.
        self._pending: tuple[ReleaseEvent, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Since when serving waits for a routing (monotonic): the process's start, reset by catch_up.
        self._waiting_since = time.monotonic()
        self._said_unconfirmed = False
        self.metrics.unconfirmed.set_function(lambda: float(self.routing() is RoutingState.UNCONFIRMED))

    def routing(self) -> RoutingState:
        """Whether a routing is applied, or how the wait for one stands (serving/readiness.py)."""
        return judge_routing(self.applied is not None, time.monotonic() - self._waiting_since,
                             self.settings.serve.routing_wait_s)

    def _say_unconfirmed(self) -> None:
        """One error line when the wait for a routing runs out (the follower thread's turns)."""
        if not self._said_unconfirmed and self.routing() is RoutingState.UNCONFIRMED:
            self._said_unconfirmed = True
            log.error("no routing for deployment %r after %.0fs (serve.routing_wait_s): taking traffic on the model "
                      "directory as version 0, which may not be the version the release controller routes users to; "
                      "is the release controller running and publishing to %s?", self.deployment,
                      self.settings.serve.routing_wait_s, self.topic)

    # -- start-up ---------------------------------------------------------------------------------
    def catch_up(self, wait_s: float) -> None:
        """Apply the newest release before serving answers; fall back to the last one applied."""
        # reported once the start is over: a refusal at start may be followed by the saved
        # release, and the controller is told the stable serving ends up serving, not the
        # model directory it held for a moment
        self._held_reports = []
        self._waiting_since = time.monotonic()
        try:
            self._catch_up(wait_s)
        finally:
            held, self._held_reports = self._held_reports, None
            for report in held:
                self._report(*report)

    def _catch_up(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        newest = None
        try:
            newest = self._read_to_end(wait_s)
        except Exception as exc:  # noqa: BLE001 - no broker at start: the local state says what to serve
            self.last_error = f"releases topic unreadable at start: {exc!r}"
            log.warning("%s", self.last_error)
            if self._consumer is not None:  # half set up: the follower thread makes a fresh one
                self._consumer.close()
                self._consumer = None
        if newest is not None:
            outcome = self._apply(*newest, deadline=deadline)
            if outcome == "applied":
                return
            if outcome == "unreachable":
                self._pending = newest  # the follower keeps trying it once serving answers
        saved = self._saved()
        if saved is not None and (self.applied is None or saved.revision > self.applied.revision):
            log.warning("starting on the last release this process applied (revision %d)", saved.revision)
            self._apply(saved, None, deadline=deadline, restoring=True)
        if self.applied is None:
            log.warning("no release for deployment %r applied yet: not ready until the release controller's routing "
                        "arrives, for up to %.0fs (serve.routing_wait_s), then serving the model directory as "
                        "version %d", self.deployment, self.settings.serve.routing_wait_s, self.fleet.slots[0].version)

    def _read_to_end(self, wait_s: float) -> tuple[ReleaseEvent, Any] | None:
        self._consumer = make_consumer(self.settings.kafka, "serving-releases", None,
                                       bootstrap_timeout_ms=max(1000, int(wait_s * 1000)))
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions_of(self._consumer, self.topic, wait_s))]
        ends = high_watermarks(self.settings.kafka, tps, client_id=f"{self.settings.kafka.client_id}-serving",
                               timeout_s=wait_s)
        self._consumer.assign(tps)
        self._consumer.seek_to_beginning(*tps)
        newest: tuple[ReleaseEvent, Any] | None = None
        deadline = time.monotonic() + wait_s
        while any(self._consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic} to its end in {wait_s:.0f}s")
            for ev, rec in self._poll(200):
                if newest is None or ev.revision > newest[0].revision:
                    newest = (ev, rec)
        return newest

    # -- following ----------------------------------------------------------------------------------
    def start(self) -> ReleaseFollower:
        self._thread = threading.Thread(target=self._run, name="release-follower", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self._consumer is not None:
            self._consumer.close()
        self.sink.settle(5.0)
        self.sink.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._say_unconfirmed()
            try:
                if self._consumer is None:  # the broker was down at start: follow from the beginning
                    self._consumer = make_consumer(self.settings.kafka, "serving-releases", None, [self.topic],
                                                   bootstrap_timeout_ms=5000)
                pending, self._pending = self._pending or self._newest(500), None
                while pending is not None and not self._stop.is_set():
                    outcome = self._apply(*pending, deadline=None)
                    pending = outcome if isinstance(outcome, tuple) else None
                self.sink.settle(0)
            except Exception as exc:  # noqa: BLE001 - the follower must outlive a broker outage
                self.last_error = repr(exc)
                log.warning("release follower: %r; retrying", exc)
                self._stop.wait(2.0)

    def _newest(self, timeout_ms: int) -> tuple[ReleaseEvent, Any] | None:
        """The newest release for this deployment in one poll that is newer than any seen."""
        best = None
        for ev, rec in self._poll(timeout_ms):
            if best is None or ev.revision > best[0].revision:
                best = (ev, rec)
        if best is not None and best[0].revision <= self._seen_revision():
            self.metrics.releases.labels("repeat" if self._is_repeat(best[0]) else "older").inc()
            return None
        return best

    def _poll(self, timeout_ms: int) -> list[tuple[ReleaseEvent, Any]]:
        out = []
        for recs in self._consumer.poll(timeout_ms=timeout_ms).values():
            for rec in recs:
                ev = self._read(rec)
                if ev is not None:
                    out.append((ev, rec))
        return out

    def _read(self, rec: Any) -> ReleaseEvent | None:
        """The one place a record becomes a release: decoded and validated against the contract,
        or dead-lettered with the reason; None too for another deployment's release."""
        try:
            self.verifier.check(rec.value, rec.headers)  # before anything reads what it says
            ev = decode(ReleaseEvent, rec.value)
        except ContractError as exc:
            self.metrics.releases.labels("unverified" if isinstance(exc, SignatureRefused) else "invalid").inc()
            log.warning("release record at %s[%d]@%d refused: %s", rec.topic, rec.partition, rec.offset, exc)
            self.dead.send_record(rec, exc.reason, exc.detail)
            return None
        if ev.deployment != self.deployment:
            self.metrics.releases.labels("other_deployment").inc()
            return None
        return ev

    def _seen_revision(self) -> int:
        return max(self.applied.revision if self.applied else -1, self.refused_revision)

    def _is_repeat(self, ev: ReleaseEvent) -> bool:
        return ev.revision in (self.refused_revision, self.applied.revision if self.applied else -1)

    # -- applying one release -----------------------------------------------------------------------
    def _apply(self, ev: ReleaseEvent, rec: Any, *, deadline: float | None,
               restoring: bool = False) -> str | tuple[ReleaseEvent, Any]:
        """``applied``, ``refused``, ``unreachable`` (deadline passed) or a newer release that
        arrived while the store was being retried."""
        t0 = time.perf_counter()
        # split by the topic's salt under the shared secret: the topic alone does not give the arms
        want = Want(ev.stable_version, ev.canary_version, ev.canary_share,
                    split_salt(self.settings.routing_secret, ev.canary_salt))
        held = [s.version for s in self.fleet.slots]
        if canary_unservable(held, want):
            self._refuse(ev, rec, ev.canary_version or 0, "no_canary_engine",
                         "this deployment runs one engine (serve.engines=1): a canary needs a second one")
            return "refused"
        steps = self.fleet.steps_for(want)
        dirs: dict[int, Path] = {}
        seconds = {"fetch": 0.0, "rebuild": 0.0, "verify": 0.0, "load": 0.0}
        for step in steps:
            if step.load is None or step.load[1] in dirs:
                continue
            version = step.load[1]
            if not self._admit(ev, rec, version, None):  # the release's word, before any byte moves
                return "refused"
            got = self._fetch(ev, rec, version, deadline, seconds)
            if not isinstance(got, Path):
                return got
            if not self._admit(ev, rec, version, got):  # the verified manifest's word
                return "refused"
            dirs[version] = got
        t_fetched = time.perf_counter()
        try:
            self.run_on_loop(lambda: self.fleet.apply(steps, dirs))
        except Exception as exc:  # noqa: BLE001 - vLLM failed to load verified bytes: keep what serves
            self._refuse(ev, rec, next(iter(dirs), ev.stable_version), "load_failed", repr(exc))
            return "refused"
        seconds["load"] = time.perf_counter() - t_fetched
        seconds["total"] = time.perf_counter() - t0
        if dirs:
            self.metrics.phase.labels("load").observe(seconds["load"])
            self.metrics.phase.labels("total").observe(seconds["total"])
        self.last_apply = {"revision": ev.revision, "loaded": sorted(dirs), "seconds": seconds}
        self.applied = ev
        self.metrics.releases.labels("applied").inc()
        self.metrics.revision.set(ev.revision)
        if not restoring:
            self._save(ev)
        self._report(ev, "applied")
        prune_cache(self.cache, self.fleet.resident_versions())
        log.info("release %d applied: %s (%s)", ev.revision, self.fleet.served_versions(), ev.reason or "no reason given")
        return "applied"

    def _fetch(self, ev: ReleaseEvent, rec: Any, version: int, deadline: float | None,
               seconds: dict[str, float]) -> Path | str | tuple[ReleaseEvent, Any]:
        if version == 0:
            return Path(self.settings.model_dir)  # verified when serving started
        backoff = 0.5
        while True:
            try:
                ref = _ref_for(ev, version)
                fetched = fetch_version(ref.uri, version, ref.manifest_sha256, self.cache)
            except VersionRefused as exc:
                self._refuse(ev, rec, version, exc.reason, exc.detail)
                return "refused"
            except (StoreUnreachable, OSError) as exc:
                self.last_error = f"checkpoint store: {exc}"
                log.warning("version %d: %s; retrying in %.1fs", version, exc, backoff)
                if deadline is not None and time.monotonic() + backoff > deadline:
                    return "unreachable"
                if deadline is None:  # following: a newer release replaces this one
                    newer = self._newest_than(ev, int(backoff * 1000))
                    if newer is not None:
                        return newer
                else:
                    time.sleep(backoff)
                if self._stop.is_set():
                    return "unreachable"
                backoff = min(backoff * 2, 30.0)
                continue
            except Exception as exc:  # noqa: BLE001 - whatever a record's URI makes a store client raise
                self._refuse(ev, rec, version, "fetch_failed", repr(exc))
                return "refused"
            for phase, spent in fetched.seconds.items():
                self.metrics.phase.labels(phase).observe(spent)
                seconds[phase] += spent
            if (self.last_error or "").startswith("checkpoint store"):
                self.last_error = None  # the store answers again
            return fetched.path

    def _admit(self, ev: ReleaseEvent, rec: Any, version: int, fetched: Path | None) -> bool:
        """Whether these engines can serve ``version``: an adapter on this serving's own base on the
        adapter engine, full weights on full-weight engines (serving/adapters.py). Judged from the
        release's ``base`` before the fetch, and from the verified manifest after it (None: not
        fetched yet); a refusal is reported as any other."""
        if version == 0:
            return True  # the model directory itself
        ref = _ref_for(ev, version) if fetched is None else None
        if fetched is not None:
            adapter = adapter_in(fetched)
        elif ref is not None and ref.base is not None:
            # rank 0: unknown until the manifest is read; the base and the kind are known now
            adapter = Adapter(ref.base.name, ref.base.manifest_sha256, 0, 1.0, ())
        else:
            return True  # a release from before adapters says nothing of the kind: fetch and see
        refusal = judge_version(version, adapter, is_base=False, lora_engine=self.lora,
                                base_sha256=self._base_sha256(), max_rank=self.settings.serve.max_lora_rank)
        if refusal is None and fetched is not None and adapter is not None \
                and adapter.base_manifest_sha256 not in self._bases_verified:
            try:
                verify_base(Path(self.settings.model_dir), adapter)
                self._bases_verified.add(adapter.base_manifest_sha256)
            except ManifestError as exc:
                refusal = Refusal("wrong_base", str(exc))
        if refusal is None:
            return True
        self._refuse(ev, rec, version, refusal.reason, refusal.detail)
        return False

    def _base_sha256(self) -> str:
        path = Path(self.settings.model_dir) / MANIFEST_NAME
        return sha256_file(path) if path.is_file() else ""

    def _newest_than(self, ev: ReleaseEvent, timeout_ms: int) -> tuple[ReleaseEvent, Any] | None:
        newer = None
        for cand, rec in self._poll(timeout_ms):
            if cand.revision > ev.revision and (newer is None or cand.revision > newer[0].revision):
                newer = (cand, rec)
        return newer

    def _refuse(self, ev: ReleaseEvent, rec: Any, version: int, reason: str, detail: str) -> None:
        self.refused_revision = max(self.refused_revision, ev.revision)
        self.metrics.releases.labels("refused").inc()
        self.metrics.refused.labels(reason).inc()
        self.last_refusal = {"revision": ev.revision, "version": version, "reason": reason, "detail": detail,
                             "at": time.time()}
        log.error("release %d refused, still serving %s: version %d %s: %s", ev.revision,
                  self.fleet.served_versions(), version, reason, detail)
        message = f"version {version} {reason}: {detail}"
        if rec is not None:
            self.dead.send_record(rec, VERSION_REFUSED, message)
        else:  # the saved release at a restart: not a record of the topic
            self.dead.send(VERSION_REFUSED, message, source_topic=self.topic,
                           value=ev.model_dump_json().encode())
        self._report(ev, "refused", version, reason, detail)
        self.sink.settle(0)

    def _report(self, ev: ReleaseEvent, outcome: ServingOutcome, version: int | None = None,
                reason: str = "", detail: str = "") -> None:
        """Tell the release controller what became of ``ev`` (flywheel.serving-status). Through the
        dead letters' sink, which keeps a record until Kafka acks it: a broker away now gets it later."""
        if self._held_reports is not None:
            self._held_reports.append((ev, outcome, version, reason, detail))
            return
        status = ServingStatusEvent(
            deployment=self.deployment, instance=self.instance, revision=ev.revision, outcome=outcome,
            stable_version=ev.stable_version, canary_version=ev.canary_version,
            serving_stable_version=self.applied.stable_version if self.applied else self.fleet.slots[0].version,
            refused_version=version, reason=reason[:64], detail=detail[:4096], at=time.time())
        self.sink.write(self.status_topic, self.deployment, encode(status))

    # -- what /health shows, and the saved release ------------------------------------------------
    def state(self) -> dict[str, Any]:
        a = self.applied
        return {"deployment": self.deployment, "revision": a.revision if a else None, "routing": self.routing().value,
                "versions": self.fleet.served_versions(),
                "canary_share": a.canary_share if a and a.canary_version is not None else 0.0,
                "last_apply": self.last_apply, "last_refusal": self.last_refusal, "last_error": self.last_error,
                # ids and counts only: /health answers any product key holder (the files are in the log)
                "signatures": self.verifier.state().counts()}

    def _save(self, ev: ReleaseEvent) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(ev.model_dump_json())
        os.replace(tmp, self.state_file)

    def _saved(self) -> ReleaseEvent | None:
        try:
            ev = decode(ReleaseEvent, self.state_file.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ContractError) as exc:
            log.warning("ignoring %s: %s", self.state_file, exc)
            return None
        return ev if ev.deployment == self.deployment else None


def _ref_for(ev: ReleaseEvent, version: int) -> VersionRef:
    """Where ``version`` lives, as the release says; the contract requires a ref for every version
    above 0, and a release that names none is refused rather than trusted to."""
    ref = ev.stable_ref if version == ev.stable_version else ev.canary_ref
    if ref is None or ref.version != version:
        raise VersionRefused(version, "malformed", f"release {ev.revision} says nowhere where version {version} lives")
    return ref
