"""The release controller's loop: every published version gated, canaried, judged, then promoted,
held for a person or rolled back; the desired routing published on ``flywheel.releases``.

One turn (:meth:`Controller.tick`), while this process holds the lease (one active controller per
database; another takes over when the lease lapses):

1. read new ``CheckpointEvent`` records and record each version as a candidate (malformed ones are
   dead-lettered; the topic is at least once and a known version is a no-op);
2. read what serving reported on ``flywheel.serving-status`` and act on its refusals
   (release/serving_state.py): a refused canary is rolled back at once with serving's reason; a
   refused promotion is taken back, so that stable is what serving serves;
3. with no canary live and the pipeline not paused: take the newest candidate (older waiting ones
   are superseded), gate it offline (release/gate.py) and either start its canary (publishing the
   routing) or reject it;
4. with a canary live: measure it from the episodes and rewards (release/measure.py), judge it
   (release/judge.py; its PASS at the level the deployment's budget across canaries gives it, its
   guardrails at the looks release/budget.py plans) and act: FAIL, ERROR or a breached guardrail
   rolls back at once, whatever the state; PASS promotes under the auto-promote policy, else
   awaits an approver; INCONCLUSIVE past the deadline holds it for a person, and so does HOLD (the
   arms' users are not the split the routing asked for) at once, whatever ``on_inconclusive`` says;
5. publish every routing revision not yet acked;
6. at the lease's take and every ``release.reannounce_s``: send the current routing again (the
   newest revision acked, or revision 0, every user on the model directory, when nothing was ever
   decided). Releases are level-triggered: serving's state follows the newest record on the topic,
   and retention, or a topic deleted and made again, can leave none; a serving that starts then
   waits, unready, for this record (``serve.routing_wait_s``, docs/serving-releases.md). The same
   revision, so a serving that applied it skips it as a repeat; a controller that lost the lease
   mid-turn and sends an older one is skipped as older.

A turn that fails on the database (not answering, read-only after a failover, a full disk, a
deadlock: any error of it) is waited out: the next turn tries again (on a new connection where
the error asks for one, release/store.py), one log line names each kind of error of the outage,
and ``release_stalled_seconds`` counts how long (the ``FlywheelStageStalled`` alert).

Each action is one transaction of the store (state, audit entry, routing revision); a ``kill -9``
between two of them leaves a state the next turn picks up from: a candidate left in ``gating`` is
gated again, an unpublished revision is published again (serving treats a revision it applied as
a no-op), a canary's measurement resumes from the offsets saved with it.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from flywheel.contracts import ServingStatusEvent, VersionRef
from flywheel.dberrors import Bug, classify, describe
from flywheel.dburl import url_secrets
from flywheel.degeneracy import compare
from flywheel.metrics import new_registry
from flywheel.scorers import load_plugins
from flywheel.settings import Settings
from release import actions
from release.budget import pass_level
from release.evals import evals_named
from release.gate import GateError, gate_record, load_prompts, measure_gate, scorers_named
from release.judge import (
    ArmStats,
    CanaryPolicy,
    GatePolicy,
    Outcome,
    PerUser,
    Verdict,
    judge_gate,
    judge_tick,
    log_e_sample_ratio,
    sample_ratio_users,
)
from release.meaning import MeaningProfile
from release.measure import Tally
from release.metrics import ControllerMetrics
from release.outcomes import Windows
from release.sequential import confidence_band, e_value, log_e_better, log_e_worse
from release.serving_state import Act, respond
from release.states import LIVE, State
from release.store import (
    AUTO_POLICY,
    SERVING_REFUSED,
    Candidate,
    LeaseLost,
    ReleaseStore,
    Revision,
    Routing,
    controller_actor,
)
from release.streams import Streams, release_event

if TYPE_CHECKING:  # numpy and the delta codec load when a version is first exported, not at import
    from flywheel.checkpoints import CheckpointStore

log = logging.getLogger(__name__)

#: A point is added to the console's history at most this often.
HISTORY_EVERY_S = 2.0
#: An announcement Kafka did not ack is tried again this soon (or at ``release.reannounce_s`` if
#: shorter), not at once: each try may wait out the producer's timeouts inside the turn.
ANNOUNCE_RETRY_S = 10.0
#: Revision 0: the routing before the controller decided anything, every user on the model directory.
NO_DECISION_YET = "no routing decided yet: every user on the model directory (version 0)"


class Controller:
    """Drives candidates through release/states.py. ``streams`` is the Kafka side;
    ``checkpoints`` the checkpoint store to load versions from (None: a controller that never
    gates, for tests of the turns after the gate)."""

    def __init__(self, settings: Settings, store: ReleaseStore, streams: Streams,
                 checkpoints: CheckpointStore | None, registry: CollectorRegistry | None = None) -> None:
        self.settings, self.cfg = settings, settings.release
        self.store, self.streams, self.checkpoints = store, streams, checkpoints
        self.holder = f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        store.fence = self.holder  # every change this controller makes checks it still holds the lease
        #: Who the audit log says acted: this instance, recognisably a controller, so that with
        #: several controllers on one database (one acting at a time) each entry names the one.
        self.actor = controller_actor(self.holder)
        self.policy_actor = f"{AUTO_POLICY} ({self.actor})"
        self.active = False
        self.last_tick = 0.0
        self._db_failing_since: float | None = None  # monotonic: the first of the turns failing on the database
        self._db_codes: set[str] = set()  # the kinds of database error of this outage logged so far
        self.prompts = load_prompts(self.cfg.prompts_file)
        load_plugins(self.cfg.plugins, "release.plugins")
        self.scorers = scorers_named(self.cfg.gate_scorers, settings.reward)
        self.evals = evals_named(self.cfg.evals, self.cfg.eval_questions, self.cfg.eval_margin)
        #: stable's answers to the evals, for the stable they were measured on ((version, manifest), by eval)
        self._stable_answers: tuple[tuple[int, str], dict[str, Any]] = ((-1, ""), {})
        self.canary_policy, self.gate_policy = CanaryPolicy.of(self.cfg), GatePolicy.of(self.cfg)
        self.metrics = ControllerMetrics(registry if registry is not None else new_registry())
        self.metrics.stalled.set_function(self.stalled_s)
        #: The newest revision a serving instance reported applied (-1: none heard yet).
        self.serving_applied = -1
        #: When the current routing is next sent again (on ``clock``; 0: on the next turn that holds the lease).
        self._next_announce = 0.0
        #: version -> failed reads in a row of the users seen before its canary (_tally): its tally is not
        #: saved until one works, so the count toward the error limit is kept here meanwhile.
        self._unseeded: dict[int, int] = {}
        #: version -> (the live canary's tally, when it was last saved: monotonic). Kept between turns
        #: so a turn neither decodes nor writes the whole tally (up to 200,000 known users and 50,000
        #: per arm): it is saved every ``release.tally_save_s``, at a verdict and at a guardrail look.
        #: A restart resumes from the saved one and reads its records again (each counted once: the
        #: tally dedupes by generation). Dropped whenever the lease may have been another's meanwhile.
        self._tallies: dict[int, tuple[Tally, float]] = {}
        #: The announcements' clock: monotonic, so a wall-clock jump neither floods nor starves them.
        self.clock = time.monotonic

    # -- the turn ---------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        try:
            self._turn(time.time() if now is None else now)
        except LeaseLost as exc:  # another controller took over while this turn ran: it acts now
            self.active = False
            self._tallies.clear()
            self.metrics.lease_held.set(0)
            log.warning("stopped mid-turn: %s; standing by", exc)
        except self.store.db.errors as exc:
            self._tallies.clear()  # the store is the truth: what this turn saved may not have landed
            if isinstance(classify(exc), Bug):  # the statement is wrong: no wait fixes it (raised, logged whole)
                raise
            self._database_failed(exc)
            return
        except Exception:
            self._tallies.clear()  # a turn cut off anywhere else: the next goes on from the saved tally
            raise
        if self._db_failing_since is not None:
            log.info("the release database works again after %.0fs", time.monotonic() - self._db_failing_since)
            self._db_failing_since = None
            self._db_codes.clear()

    def _database_failed(self, exc: BaseException) -> None:
        """Every transaction is one (release/store.py), so a turn cut off anywhere left the store
        consistent, and the next turn picks up from it (the module docstring): wait, and say
        once per kind of error what the database does, not a traceback per turn."""
        if self._db_failing_since is None:
            self._db_failing_since = time.monotonic()
        code = classify(exc).code
        if code not in self._db_codes:
            self._db_codes.add(code)
            log.warning("a controller turn failed on the release database (%s); trying again every turn until it "
                        "works", describe(exc, url_secrets(self.store.db.url)))
        else:
            log.debug("still failing on the release database: %s", describe(exc, url_secrets(self.store.db.url)))

    def stalled_s(self) -> float:
        """Seconds the controller's turns have failed on the database in a row (0 while fine)."""
        return 0.0 if self._db_failing_since is None else time.monotonic() - self._db_failing_since

    def _turn(self, now: float) -> None:
        lapsed = self.last_tick and time.monotonic() - self.last_tick > self.cfg.lease_ttl_s
        self.last_tick = time.monotonic()
        was_active, self.active = self.active, self.store.take_lease(self.holder, self.cfg.lease_ttl_s)
        self.metrics.lease_held.set(int(self.active))
        if not (self.active and was_active) or lapsed:
            self._tallies.clear()  # another controller may have measured meanwhile: read its tally
        if not self.active:
            if was_active:
                log.warning("lost the controller lease: standing by")
            return
        if not was_active:
            log.info("holding the controller lease as %s", self.holder)
            self._next_announce = 0.0  # a new leader says what the routing is, before any period
        for event in self.streams.new_checkpoints():
            if self.store.add_candidate(event, self.actor):
                log.info("version %d is a candidate", event["version"])
        self.streams.commit_checkpoints()  # only once every one of them is stored
        self._follow_serving()
        live = self.store.candidates(set(LIVE))
        for version in [v for v in self._tallies if not live or v != live[-1].version]:
            del self._tallies[version]  # decided: nothing more to measure
        if live:
            self._measure(live[-1], now)
        elif not self.store.paused():
            self._next_candidate()
        self._publish()
        self._announce()

    def status(self) -> dict[str, Any]:
        """This loop's own report, for the API: what it knows in memory, no database read. The API
        calls it from its threads, and this controller's store (its connection, maybe inside a
        transaction of this loop's) is not for them: the API reads the lease through its own."""
        return {"controller": self.holder, "active": self.active,
                "last_tick_age_s": round(time.monotonic() - self.last_tick, 3) if self.last_tick else None,
                # whether checkpoints are verified, shown where people look (the console, /api/status),
                # not only in the start-up log: docs/signing.md
                "signing": self.streams.signing()}

    # -- serving's reports ------------------------------------------------------------------
    def _follow_serving(self) -> None:
        saved = self.store.serving_status_offsets()
        try:
            statuses, offsets = self.streams.serving_statuses(saved, self.cfg.deployment)
        except Exception as exc:  # noqa: BLE001 - read again next turn; gating, measuring and publishing go on
            log.warning("serving's reports not read this turn: %r", exc)
            return
        for status in statuses:
            self._heard(status)
        if offsets != (saved or {}):  # after the actions: a crash between reads them again (acts once)
            self.store.save_serving_status_offsets(offsets)

    def _heard(self, status: ServingStatusEvent) -> None:
        if status.outcome == "applied":
            self.serving_applied = max(self.serving_applied, status.revision)
            self.metrics.serving_applied.set(self.serving_applied)
            return
        live = self.store.candidates(set(LIVE))
        response = respond(status, live[-1].version if live else None, self.store.latest_revision(),
                           self.store.was_stable)
        self.metrics.serving_refusals.labels(response.act.value).inc()
        log.warning("%s (%s)", response.reason, response.act.value)
        evidence = {SERVING_REFUSED: status.model_dump(mode="json")}
        if response.act == Act.ROLL_BACK_CANARY:
            try:
                actions.rollback(self.store, self.actor, response.reason, evidence, response.version)
            except actions.ActionRefused as exc:  # a person ended it meanwhile: theirs stands
                log.info("canary v%s not rolled back after serving's refusal: %s", response.version, exc)
        elif response.act == Act.KEEP_SERVING_STABLE and response.version is not None:
            self.store.keep_serving_stable(response.version, status.revision, self.actor, response.reason, evidence)

    # -- gate -------------------------------------------------------------------------------
    def _next_candidate(self) -> None:
        waiting = self.store.candidates({State.CANDIDATE, State.GATING})
        if not waiting:
            return
        newest = waiting[-1]
        for old in waiting[:-1]:
            self.store.transition(old.version, State.SUPERSEDED, self.actor,
                                  f"version {newest.version} is newer and waited too")
        if newest.version <= self.store.stable_version():
            self.store.transition(newest.version, State.SUPERSEDED, self.actor,
                                  f"stable is already version {self.store.stable_version()}")
            return
        self.store.transition(newest.version, State.GATING, self.actor, "offline gate on the held-out prompts")
        t0 = time.monotonic()
        try:
            verdict, record = self._gate(newest)
        except self.store.db.errors:
            raise  # the database's, not the candidate's: waited out (tick), never counted against it
        except Exception as exc:  # noqa: BLE001 - any failure of a gate counts toward the limit, never promotes
            self.metrics.gate_seconds.observe(time.monotonic() - t0)
            self.metrics.gate_verdicts.labels(Outcome.ERROR.value).inc()
            self._gate_failed(newest, exc)
            return
        self.metrics.gate_seconds.observe(time.monotonic() - t0)
        self.metrics.gate_verdicts.labels(verdict.outcome.value).inc()
        log.info("version %d gated in %.1f s: %s", newest.version, time.monotonic() - t0, verdict.outcome.value)
        if not self.store.take_lease(self.holder, self.cfg.lease_ttl_s):
            # the gate outlasted the lease and another controller took over: it acts, not this one
            self.active = False
            log.warning("lost the controller lease during the gate of version %d: standing by", newest.version)
            return
        self.store.save(newest.version, gate={"outcome": verdict.outcome.value, "reasons": list(verdict.reasons),
                                              "measurement": record})
        if verdict.outcome == Outcome.PASS:
            stable = self.store.stable_version()
            # where the measurement starts: the topics' ends as the canary goes live (a crash
            # before this is saved starts it at the first measurement instead, a little later)
            offsets = self.streams.ends()
            self.store.transition(
                newest.version, State.CANARY, self.actor,
                f"gate passed; canary for {self.cfg.canary_share:.0%} of users against stable v{stable}",
                {"gate": record}, Routing(stable, newest.version, self.cfg.canary_share))
            tally = Tally(stable_version=stable, canary_version=newest.version, started_at=time.time(),
                          alpha=self._pass_alpha(), share=self.cfg.canary_share)
            tally.offsets = offsets
            tally.windows = Windows.of(self.settings)
            # raises where the broker does not answer: the canary is live with no tally, and the
            # next turn makes one (_tally), never one that knows no user
            self._know_users_before(tally)
            self.store.save(newest.version, analysis={"outcome": Outcome.RUNNING.value, "reasons": []},
                            tally=tally.to_dict())
        else:
            self.store.transition(newest.version, State.REJECTED, self.actor, "gate failed: " + "; ".join(verdict.reasons),
                                  {"gate": record})

    def _gate(self, cand: Candidate) -> tuple[Verdict, dict[str, Any]]:
        stable = self.store.stable_version()
        with tempfile.TemporaryDirectory(prefix="flywheel-gate-") as tmp:
            cand_dir = self._verified_dir(cand.version, cand.manifest_sha256, Path(tmp) / "candidate")
            stable_dir = self._stable_dir(stable, Path(tmp) / "stable")
            key = (stable, self.store.get(stable).manifest_sha256 if stable else str(self.settings.model_dir))
            if self._stable_answers[0] != key:
                self._stable_answers = (key, {})
            m = measure_gate(stable_dir, cand_dir, self.prompts, max_new_tokens=self.cfg.gate_max_new_tokens,
                             trainer_metrics=cand.checkpoint.get("metrics", {}), scorers=self.scorers,
                             base_dir=Path(self.settings.model_dir), evals=self.evals,
                             eval_max_new_tokens=self.cfg.eval_max_new_tokens,
                             stable_answers=self._stable_answers[1])
        # the stable version it was measured against, with the measurement: a report reads each
        # version's held-out scores from the audit log (local/report.py), undos and all
        return judge_gate(m, self.gate_policy), {**gate_record(m), "stable_version": stable}

    def verify(self, cand: Candidate) -> None:
        """:func:`verify_version` against this controller's checkpoint store."""
        verify_version(self.checkpoints, cand)

    def _verified_dir(self, version: int, manifest_sha256: str, out: Path) -> Path:
        cand = self.store.get(version)
        return verified_dir(self.checkpoints, version, manifest_sha256, out, cand.uri if cand is not None else None)

    def _stable_dir(self, stable: int, out: Path) -> Path:
        if stable == 0:
            return Path(self.settings.model_dir)
        cand = self.store.get(stable)
        if cand is None:
            raise GateError(f"stable version {stable} is not known to this controller")
        return self._verified_dir(stable, cand.manifest_sha256, out)

    def _gate_failed(self, cand: Candidate, exc: BaseException) -> None:
        # counted in the audit log, so a gate that kills the process (out of memory) still ends
        n = 1 + sum(e.reason.startswith("gate error ") for e in self.store.audit(cand.version))
        reason = f"gate error {n} of {self.cfg.error_limit}: {type(exc).__name__}: {exc}"
        log.warning("version %d: %s", cand.version, reason)
        if n >= self.cfg.error_limit:
            self.store.transition(cand.version, State.REJECTED, self.actor, reason)
        else:
            self.store.note(cand.version, self.actor, reason)  # stays gating: the next turn tries again

    # -- canary -----------------------------------------------------------------------------
    def _measure(self, cand: Candidate, now: float) -> None:
        tally, seeded = self._tally(cand, now)
        failing = tally.errors > 0
        try:
            if seeded:
                read = self.streams.read_into(tally)
                tally.errors = 0  # the limit is on failures in a row, as in Argo's consecutiveErrorLimit
                log.debug("version %d: %d records measured, offsets %s", cand.version, read, tally.offsets)
        except Exception as exc:  # noqa: BLE001 - a failed measurement counts toward the error limit
            tally.errors += 1
            log.warning("version %d: measurement failed (%d of %d): %s", cand.version, tally.errors,
                        self.cfg.error_limit, exc)
        m = tally.measurement(now)
        # the guardrails' look due now is taken once (release/budget.py), and saved with the tally
        look = tally.guardrail_look
        verdict, tally.guardrail_look = judge_tick(m, replace(self.canary_policy, pass_alpha=tally.alpha),
                                                   tally.guardrail_look)
        if not seeded and verdict.outcome == Outcome.RUNNING:
            return  # saved, it would count every returning user as new: the next turn reads them again
        ends = verdict.outcome in (Outcome.FAIL, Outcome.ERROR) or (
            cand.state == State.CANARY and verdict.outcome != Outcome.RUNNING)
        if verdict.outcome in (Outcome.FAIL, Outcome.ERROR):
            tally.guardrail_look = look  # saved as not taken: a rollback that does not land is judged again
        self._record(cand, tally, verdict, now,
                     save=ends or tally.guardrail_look != look or failing != (tally.errors > 0))
        evidence = {"verdict": verdict.outcome.value, "reasons": list(verdict.reasons),
                    "stable": _arm_record(m.stable), "canary": _arm_record(m.canary), "pairs": asdict(m.pairs),
                    "excluded_users": m.excluded_users}
        why = "; ".join(verdict.reasons)
        if verdict.outcome in (Outcome.FAIL, Outcome.ERROR):
            actions.rollback(self.store, self.actor, f"analysis {verdict.outcome.value}: {why}", evidence, cand.version)
        elif verdict.outcome == Outcome.HOLD and cand.state == State.CANARY:
            # not rolled back: nothing says the version is worse, the split is wrong; a person
            # finds why (release/README.md, "Sample ratio") before any verdict is trusted
            self.store.transition(cand.version, State.HELD, self.actor, f"held for a person: {why}", evidence)
        elif verdict.outcome == Outcome.HOLD:
            return  # awaiting approval: the policy promotes nothing while the split is wrong
        elif cand.state == State.AWAITING_APPROVAL and self.cfg.auto_promote:
            self._promote_when_allowed(cand, evidence)
        elif cand.state != State.CANARY:
            return  # awaiting a person: only a failure acts on its own
        elif verdict.outcome == Outcome.PASS:
            self._passed(cand, why, evidence)
        elif verdict.outcome == Outcome.INCONCLUSIVE and self.cfg.on_inconclusive == "rollback":
            actions.rollback(self.store, self.actor, f"no verdict by the deadline, rolled back so a newer version gets its "
                                                f"turn (release.on_inconclusive=rollback): {why}", evidence, cand.version)
        elif verdict.outcome == Outcome.INCONCLUSIVE:
            self.store.transition(cand.version, State.HELD, self.actor, f"held for a person: {why}", evidence)

    def _passed(self, cand: Candidate, why: str, evidence: dict[str, Any]) -> None:
        if self.cfg.auto_promote:
            try:
                actions.promote(self.store, cand.version, self.policy_actor, f"analysis passed: {why}",
                                self.cfg.promotion_interval_s, evidence, by_policy=True)
                return
            except actions.ActionRefused as exc:
                why = f"{why}; waits to be promoted automatically: {exc}"
        self.store.transition(cand.version, State.AWAITING_APPROVAL, self.actor, f"analysis passed: {why}", evidence)

    def _promote_when_allowed(self, cand: Candidate, evidence: dict[str, Any]) -> None:
        """Under the auto-promote policy, a passed canary that waited out the promotion interval."""
        last = self.store.last_promotion_at()
        if last is not None and time.time() - last < self.cfg.promotion_interval_s:
            return
        try:
            actions.promote(self.store, cand.version, self.policy_actor, "analysis passed; the promotion interval is over",
                            self.cfg.promotion_interval_s, evidence, by_policy=True)
        except actions.ActionRefused as exc:  # raced with a person's decision: theirs stands
            log.info("version %d not promoted automatically: %s", cand.version, exc)

    def _tally(self, cand: Candidate, now: float) -> tuple[Tally, bool]:
        """The canary's tally, and False where it is new and reading the users seen before the
        canary failed: it then only carries the failures toward the error limit, so the judge's
        rule for measurement errors (and the deadline) still ends a canary whose broker stalls."""
        if cand.version in self._tallies:
            return self._tallies[cand.version][0], True
        saved = self.store.tally(cand.version)
        if saved:
            tally = Tally.from_dict(saved)
            self._tallies[cand.version] = (tally, time.monotonic())
            return tally, True
        rev = self.store.latest_revision()
        tally = Tally(stable_version=rev.stable_version if rev else 0, canary_version=cand.version,
                      started_at=rev.at if rev else now, alpha=self._pass_alpha(),
                      share=rev.canary_share if rev and rev.canary_version == cand.version else None)
        tally.windows = Windows.of(self.settings)
        try:
            tally.offsets = self.streams.ends()  # measure what users do from now on
            self._know_users_before(tally)
        except (LeaseLost, *self.store.db.errors):
            raise  # tick stands by, or waits the database out
        except Exception as exc:  # noqa: BLE001 - a stalled broker, a record that does not decode: the next turn tries again
            tally.errors = self._unseeded[cand.version] = self._unseeded.get(cand.version, 0) + 1
            log.warning("version %d: reading the users seen before its canary failed (%d of %d): %s", cand.version,
                        tally.errors, self.cfg.error_limit, exc)
            return tally, False
        self._unseeded.pop(cand.version, None)
        return tally, True

    def _know_users_before(self, tally: Tally) -> None:
        """Seed a new tally with the users seen before its canary started, read from the episodes
        of ``release.known_users_lookback_s`` before its start offsets (release/streams.py
        ``known_users``). A saved tally keeps its own: a resumed canary reads none again."""
        if tally.windows.count_new_users:
            return  # release.new_users = "count": who is new does not matter
        ends = tally.offsets.get(self.streams.topics.episodes, {})
        for user in self.streams.known_users(ends, self.cfg.known_users_lookback_s, tally.started_at,
                                             keep=self._keep_lease, keep_every_s=self.cfg.lease_ttl_s / 3):
            tally.windows.know(user)

    def _keep_lease(self) -> None:
        """Renew the lease in a long step of a turn; LeaseLost (tick stands by) once another holds it."""
        if not self.store.take_lease(self.holder, self.cfg.lease_ttl_s):
            raise LeaseLost(f"{self.holder} lost the controller lease while reading the users seen before a canary")

    def _pass_alpha(self) -> float:
        """The level the live canary's PASS is tested at: the budget across this deployment's
        canaries (release/budget.py ``pass_level``), from the canaries the audit log says ran
        before it and which of them passed. Read as it starts and saved with its tally, so it
        stays fixed."""
        started = self.store.canary_passes()  # the live canary is the last started: not before itself
        return pass_level(self.cfg.alpha, self.cfg.budget_canaries, started[:-1])

    def _record(self, cand: Candidate, tally: Tally, verdict: Verdict, now: float, save: bool) -> None:
        """Save the analysis the console shows, and the tally when ``save`` or due (``_tallies``)."""
        kept = self._tallies.get(cand.version)
        save = save or kept is None or time.monotonic() - kept[1] >= self.cfg.tally_save_s
        m = tally.measurement(now)
        band = confidence_band(m.pairs, self.canary_policy.alpha)
        eb, ew = e_value(log_e_better(m.pairs)), e_value(log_e_worse(m.pairs))
        if not tally.history or now - tally.history[-1]["t"] >= HISTORY_EVERY_S:
            tally.history.append({"t": now, "stable_rate": m.stable.accept_rate, "canary_rate": m.canary.accept_rate,
                                  "band_lo": band[0], "band_hi": band[1], "e_better": eb, "e_worse": ew})
            del tally.history[:-500]  # the console draws the last few hundred points
        # the degeneracy guardrails' numbers as the console shows them (the sums behind them are in
        # the tally): each arm's character repetition, share of the class that moved most, share
        # of answers collapsed against stable's median
        shift = compare(m.stable.text, m.canary.text)
        arms = {name: {**{k: v for k, v in asdict(arm).items() if k not in ("text", "meaning")},
                       "accept_rate": arm.accept_rate,
                       "error_rate": arm.error_rate, "reject_share": arm.reject_share, "flag_rate": arm.flag_rate,
                       "repetition": getattr(shift.repetition, side),
                       "char_class_share": getattr(shift.char_class, side),
                       "collapsed_share": getattr(shift.collapsed, side), **_said(arm.meaning),
                       **_per_user(arm.per_user)}
                for name, side, arm in (("stable", "stable", m.stable), ("canary", "candidate", m.canary))}
        self.store.save(cand.version, analysis={
            "outcome": verdict.outcome.value, "reasons": list(verdict.reasons), **arms,
            "char_class": shift.char_class.what,
            "pairs": asdict(m.pairs), "e_better": eb, "e_worse": ew, "band": list(band),
            "alpha": self.canary_policy.alpha, "pass_alpha": tally.alpha or self.canary_policy.alpha,
            "guardrail_look": tally.guardrail_look, "canary_share": tally.share,
            "sample_ratio_e": (e_value(log_e_sample_ratio(*sample_ratio_users(m), share))
                               if (share := m.canary_share) is not None and 0 < share < 1 else None),
            "excluded_users": m.excluded_users, "flagged_after_counting": m.flagged_after_counting,
            "elapsed_s": m.elapsed_s, "history": tally.history, **tally.left_apart()},
            tally=tally.to_dict() if save else None)
        if save:
            self._tallies[cand.version] = (tally, time.monotonic())

    # -- routing ----------------------------------------------------------------------------
    def _publish(self) -> None:
        todo = [rev for rev in self.store.unpublished() if self._publishable(rev)]
        if todo:
            done = self.streams.publish(todo, self.cfg.deployment, self._ref)
            self.store.mark_published(done)
            if done:  # the newest routing just went out: that is this period's announcement
                self._next_announce = self.clock() + self.cfg.reannounce_s

    def _announce(self) -> None:
        """Send the current routing again when its period is up (module docstring, step 6)."""
        if self.clock() < self._next_announce or self.store.unpublished():
            return  # a revision waiting to be published goes first, and is the newer word
        rev = self.store.current_routing()
        if rev is None and self.store.latest_revision() is None:
            # the first start of a deployment: a serving waits for a routing, and this is it
            rev = Revision(0, 0, None, 0.0, NO_DECISION_YET, time.time())
        if rev is None:
            return  # revisions exist and none was ever acked (all skipped): nothing true to repeat
        sent = self.streams.announce(rev, self.cfg.deployment, self._ref)
        self.metrics.announcements.labels("sent" if sent else "failed").inc()
        self._next_announce = self.clock() + (self.cfg.reannounce_s if sent
                                                  else min(self.cfg.reannounce_s, ANNOUNCE_RETRY_S))

    def _publishable(self, rev: Revision) -> bool:
        """False for a revision no release record can carry (a version recorded before the
        checkpoint contract bounded its uri, say), which is marked skipped with the reason in the
        audit log: it would fail the same way every turn, and the revisions after it, a rollback
        among them, must still go out."""
        try:
            release_event(rev, self.cfg.deployment, self._ref)
            return True
        except ValidationError as exc:
            why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            log.error("revision %d cannot be published, skipped: %s", rev.revision, why)
            self.store.skip_revision(rev.revision, self.actor, f"revision {rev.revision} cannot be published: {why}")
            return False

    def _ref(self, version: int) -> VersionRef | None:
        cand = self.store.get(version)
        # an adapter version names its base (the checkpoint event's), so serving can tell
        return None if cand is None else VersionRef(version=version, uri=cand.uri, manifest_sha256=cand.manifest_sha256,
                                                     base=cand.checkpoint.get("base"))


def _per_user(pu: PerUser) -> dict[str, float | int]:
    """An arm's users and their mean rates, as the per-user guardrails judge them (the console)."""
    def mean(total: float, n: int) -> float:
        return total / n if n else 0.0
    return {"users": pu.users, "user_error_rate": mean(pu.error_sum, pu.users),
            "user_reject_share": mean(pu.reject_sum, pu.users), "user_flag_rate": mean(pu.flag_sum, pu.raters)}


def _said(mp: MeaningProfile) -> dict[str, float]:
    """An arm's answers as the checks on what they say judge them (release/meaning.py; the console)."""
    return {"leading_share": mp.leading.top()[1], "affix_share": mp.affix()[1],
            "unrelated_share": mp.unrelated_share, "whole_repetition": mp.repetition,
            "distinct_share": mp.distinct_share()}


def _arm_record(arm: ArmStats) -> dict[str, Any]:
    """An arm's measurement as evidence in the audit log, without the answers' digests."""
    out = asdict(arm)
    out["meaning"]["seen"] = len(arm.meaning.seen)
    out["meaning"]["novel"] = arm.meaning.sampled
    return out


#: Versions an object store's cache keeps (the newest fetched): a gate reads the candidate and
#: stable, and the next candidate's delta chain usually starts at one of them.
CACHE_KEEP = 3


def verified_dir(checkpoints: CheckpointStore | None, version: int, manifest_sha256: str, out: Path,
                 uri: str | None = None) -> Path:
    """The version rebuilt from its delta chain into ``out``, every hash checked, and its manifest
    the one the checkpoint event announced. A ``uri`` on an object store (the trainer's ``store``
    an ``s3://`` URL) is fetched into a cache under the local store first, as serving fetches it
    (flywheel/checkpoints/fetch.py): no volume is shared with the trainer. A path or a ``file://``
    URL is read from this controller's own store (the shared volume)."""
    from flywheel.checkpoints import CheckpointStore, verify_dir
    from flywheel.checkpoints.fetch import fetch_version, prune_cache
    from flywheel.checkpoints.remote import is_remote

    if checkpoints is None:
        raise GateError("this controller was given no checkpoint store to load versions from")
    if uri is not None and is_remote(uri):
        cache = CheckpointStore(checkpoints.root / "fetched")
        fetch_version(uri, version, manifest_sha256, cache)
        cache.export(version, out)
        prune_cache(cache, set(cache.versions()[-CACHE_KEEP:]))
    else:
        checkpoints.export(version, out)
    verify_dir(out, expect_manifest_sha256=manifest_sha256)
    return out


def verify_version(checkpoints: CheckpointStore | None, cand: Candidate) -> None:
    """Rebuild ``cand`` from the checkpoint store and check every hash against the manifest its
    announcement named: ``release undo`` calls it before routing users back to a version, since
    the store may have lost or damaged it after it was promoted. Raises on any mismatch."""
    with tempfile.TemporaryDirectory(prefix="flywheel-verify-") as tmp:
        verified_dir(checkpoints, cand.version, cand.manifest_sha256, Path(tmp) / "version", cand.uri)
