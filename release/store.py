"""The release controller's durable state: candidates, an append-only audit log, the release
revisions it publishes, the pipeline's pause flag and the controller lease, in one database.

SQLite by default (``<data_dir>/release/release.sqlite3``), PostgreSQL when
``FLYWHEEL_DATABASE_URL`` names one (``postgresql://...``); the same SQL runs on both, and the
state-machine tests run against both. Every transition is ONE transaction: the candidate's new
state, its audit entry (who or what, when, why, and the measurements behind it) and, when the
routing changes, the new release revision. A ``kill -9`` at any point leaves either all of it or
none of it. Revisions are published to ``flywheel.releases`` after their transaction commits and
marked published when Kafka acks them; a restart publishes the ones not marked (at least once:
serving treats a revision it has applied as a no-op).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from flywheel.dberrors import Reconnect, classify
from flywheel.settings import refuse_leaking_url
from release.states import FINAL, LIVE, State, TransitionRefused, check

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS release_candidates (
    version BIGINT PRIMARY KEY, parent BIGINT, state TEXT NOT NULL, uri TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL, checkpoint TEXT NOT NULL, gate TEXT, analysis TEXT,
    created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
    -- the controller's working state of a live canary (release/measure.py), NULL once final
    tally TEXT);
CREATE TABLE IF NOT EXISTS release_audit (
    id {ID}, version BIGINT, from_state TEXT, to_state TEXT, actor TEXT NOT NULL,
    reason TEXT NOT NULL, evidence TEXT, at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS release_revisions (
    revision BIGINT PRIMARY KEY, stable_version BIGINT NOT NULL, canary_version BIGINT,
    canary_share DOUBLE PRECISION NOT NULL, reason TEXT NOT NULL, at DOUBLE PRECISION NOT NULL,
    published INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS release_meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS release_lease (
    name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at DOUBLE PRECISION NOT NULL);
"""


#: ``release_revisions.published``: 0 waits to be published, then one of these.
PUBLISHED, SKIPPED = 1, 2


@dataclass(frozen=True)
class Candidate:
    version: int
    parent: int | None
    state: State
    uri: str
    manifest_sha256: str
    checkpoint: dict[str, Any]
    gate: dict[str, Any] | None
    analysis: dict[str, Any] | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class AuditEntry:
    id: int
    version: int | None
    from_state: str | None
    to_state: str | None
    actor: str
    reason: str
    evidence: dict[str, Any] | None
    at: float


@dataclass(frozen=True)
class Revision:
    """Desired routing, as published on ``flywheel.releases``."""

    revision: int
    stable_version: int
    canary_version: int | None
    canary_share: float
    reason: str
    at: float
    published: bool = False
    #: never to be published: no release record could be built from it (the audit log says why)
    skipped: bool = False


@dataclass(frozen=True)
class Routing:
    """What a transition changes in the routing (None: it changes nothing)."""

    stable_version: int
    canary_version: int | None
    canary_share: float


@dataclass(frozen=True)
class BackToStable:
    """A routing change decided inside the transition, from what the database holds then: every
    user back to the stable version of that moment when the candidate serves canary traffic (its
    state is live, or the newest routing names it as canary), no change otherwise.

    Decided before the transaction, it raced with the gate: a reject that read "gating" while the
    gate committed the canary left the version rejected and still routed, beyond any rollback."""


#: The advisory lock the release store's replicas take turns on to make its schema (any number
#: no other part of a deployment's database takes; "FLYW" "RELS" in ASCII).
SCHEMA_LOCK = 0x464C5957_52454C53


class _Db:
    """The one place that knows which database it is: placeholders, ids, row locks, and what an
    error of it asks for (flywheel/dberrors.py): a connection that one made useless (lost, or a
    session that cannot write: read-only after a failover) is replaced before the next use."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        self._in_txn = False
        #: The last error asked for a new connection (dberrors.Reconnect): made before the next use.
        self._stale = False
        #: Every error of this database's driver: the controller waits them out (Controller.tick).
        self.errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
        if self.postgres:
            import psycopg  # only a PostgreSQL deployment needs it

            refuse_leaking_url(url)
            self.conn: Any = psycopg.connect(url, autocommit=True)
            self.errors = (psycopg.Error,)
            self.for_update = " FOR UPDATE"
            # Revisions are numbered max + 1: two transactions changing the routing at once would
            # read the same max and the second would fail on the duplicate key. They take turns
            # on this lock (readers are not blocked); SQLite's BEGIN IMMEDIATE serialises already.
            self.lock_revisions = "LOCK TABLE release_revisions IN SHARE ROW EXCLUSIVE MODE"
            ddl = _SCHEMA.replace("{ID}", "BIGSERIAL PRIMARY KEY")
            # The replicas of a fresh install make the schema at once, and concurrent CREATE
            # TABLE IF NOT EXISTS of one table collide in PostgreSQL's catalog (UniqueViolation
            # on pg_type's name index): one replica crashed on every fresh install. They take
            # turns on a lock held to the end of the DDL's transaction.
            with self.conn.transaction():
                self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                for stmt in filter(str.strip, ddl.split(";")):
                    self.conn.execute(stmt)
        else:
            path = Path(url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.for_update = ""  # BEGIN IMMEDIATE already holds the write lock
            self.lock_revisions = ""
            self.conn.executescript(_SCHEMA.replace("{ID}", "INTEGER PRIMARY KEY AUTOINCREMENT"))

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        if self.postgres:
            sql = sql.replace("?", "%s")
        if self._in_txn:
            return self._run(sql, params)
        self._reconnect_if_broken()
        try:
            return self._run(sql, params)
        except self.errors:
            # a read on its own (every write is in a transaction): safe to try once more on a
            # new connection when the old one was dropped
            if not (self.postgres and self.conn.broken):
                raise
            self._reconnect_if_broken()
            return self._run(sql, params)

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        try:
            return self.conn.execute(sql, params)
        except self.errors as exc:
            self._judge(exc)
            raise

    def _judge(self, exc: BaseException) -> None:
        if isinstance(classify(exc), Reconnect):
            self._stale = True

    @contextmanager
    def txn(self) -> Iterator[None]:
        self._reconnect_if_broken()
        self._in_txn = True
        try:
            if self.postgres:
                try:
                    with self.conn.transaction():
                        yield
                except self.errors as exc:  # a COMMIT refused or cut off too
                    self._judge(exc)
                    raise
                return
            self._run("BEGIN IMMEDIATE")
            try:
                yield
                self._run("COMMIT")
            except BaseException:
                # a COMMIT refused (busy, full) leaves the transaction open; one SQLite rolled
                # back itself (some I/O and full-disk errors) leaves none to roll back
                if self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.conn.execute("ROLLBACK")
                raise
        finally:
            self._in_txn = False

    def _reconnect_if_broken(self) -> None:
        """A new connection when the server dropped this one (a database restart, a failover, an
        idle timeout) or an error made it useless (a session begun read-only stays so for its
        life, a standby's after a failover included): the next statement or transaction runs on
        it rather than failing until the process restarts. A transaction cut off fails as a
        whole; its caller's next turn redoes it. Raises while the database does not answer."""
        if self.postgres and (self._stale or self.conn.broken or self.conn.closed):
            import psycopg

            conn = psycopg.connect(self.url, autocommit=True)
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn, self._stale = conn, False
        elif not self.postgres and self._stale:
            # ``mode=rw``: a file gone is an error, never a new empty store
            path = Path(self.url.removeprefix("sqlite:///")).absolute()
            conn = sqlite3.connect(f"{path.as_uri()}?mode=rw", uri=True, isolation_level=None, timeout=30.0,
                                   check_same_thread=False)
            conn.execute("PRAGMA synchronous=FULL")
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()
            self.conn, self._stale = conn, False

    def close(self) -> None:
        self.conn.close()


def database_url(url: str | None, data_dir: Path) -> str:
    """``url`` when given, else the embedded SQLite file under ``data_dir``."""
    return url or f"sqlite:///{data_dir / 'release' / 'release.sqlite3'}"


def controller_actor(holder: str) -> str:
    """How the audit log names a controller instance: ``controller:<holder>`` (the lease holder,
    ``<hostname>:<random>``), so an entry says which one acted and still reads as a controller's."""
    return f"controller:{holder}"


#: The written policy that promotes without a person, as the audit log names it (with the
#: controller instance that applied it: ``auto-promote policy (controller:<holder>)``).
AUTO_POLICY = "auto-promote policy"


class ActorKind(StrEnum):
    """Who an audit entry says acted, by kind: a person (a token's name), the auto-promote policy,
    or a controller instance acting on its own rules."""

    PERSON = "person"
    POLICY = "policy"
    CONTROLLER = "controller"


def actor_kind(actor: str) -> ActorKind:
    if actor.startswith(AUTO_POLICY):
        return ActorKind.POLICY
    if actor.startswith("controller:") or actor == "controller":
        return ActorKind.CONTROLLER
    return ActorKind.PERSON


#: The evidence key of an audit entry that returned stable to an earlier version (:meth:`ReleaseStore.undo`).
UNDO = "undo"
#: The evidence key of an audit entry that takes back a routing serving refused (release/serving_state.py).
SERVING_REFUSED = "serving_refused"


class LeaseLost(RuntimeError):
    """A fenced store's holder no longer holds the controller lease: it must stand by."""


class ReleaseStore:
    def __init__(self, url: str) -> None:
        self.db = _Db(url)
        #: Set by a controller to its lease holder name: every transition and save of this store
        #: then checks, inside its own transaction, that this holder still holds a live lease, so
        #: a controller whose turn outlasted its lease cannot act after another took over. The
        #: API's store is not fenced: people act whoever holds the lease.
        self.fence: str | None = None

        #: Called with every audit entry once its transaction has committed (release/decisions.py
        #: counts decisions and sends webhooks from them); a listener that raises is logged, never
        #: undoes or fails the change.
        self.listeners: list[Callable[[AuditEntry], None]] = []
        self._written: list[AuditEntry] = []

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _txn(self) -> Iterator[None]:
        """One transaction; its audit entries go to :attr:`listeners` once it has committed."""
        self._written = []
        with self.db.txn():
            yield
        written, self._written = self._written, []
        for entry in written:
            for listener in self.listeners:
                try:
                    listener(entry)
                except Exception:  # a listener's failure is its own, not the change's
                    log.exception("an audit listener failed on entry %d", entry.id)

    # -- candidates ------------------------------------------------------------------------
    def add_candidate(self, event: dict[str, Any], actor: str) -> bool:
        """Record a published version as a candidate (a ``CheckpointEvent`` as a dict); False when
        it is known already (the checkpoints topic is at least once)."""
        now = time.time()
        with self._txn():
            if self.db.execute("SELECT 1 FROM release_candidates WHERE version=?", (event["version"],)).fetchone():
                return False
            self.db.execute(
                "INSERT INTO release_candidates VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, NULL)",
                (event["version"], event.get("parent"), State.CANDIDATE.value, event["uri"],
                 event["manifest_sha256"], json.dumps(event), now, now))
            self._audit(event["version"], None, State.CANDIDATE, actor,
                        f"version {event['version']} published by the trainer (step {event.get('step')})",
                        {"metrics": event.get("metrics", {})}, now)
        return True

    def get(self, version: int) -> Candidate | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM release_candidates WHERE version=?", (version,)).fetchone()
        return _candidate(row) if row else None

    def candidates(self, states: set[State] | None = None) -> list[Candidate]:
        if states is None:
            rows = self.db.execute(f"SELECT {_COLUMNS} FROM release_candidates ORDER BY version").fetchall()
        else:  # filtered in SQL: a history of many candidates is not parsed to find the live one
            marks = ", ".join("?" for _ in states)
            rows = self.db.execute(f"SELECT {_COLUMNS} FROM release_candidates WHERE state IN ({marks}) "
                                   "ORDER BY version", tuple(sorted(s.value for s in states))).fetchall()
        return [_candidate(r) for r in rows]

    def tally(self, version: int) -> dict[str, Any] | None:
        """The saved working state of a live canary's measurement (None: none saved)."""
        row = self.db.execute("SELECT tally FROM release_candidates WHERE version=?", (version,)).fetchone()
        return json.loads(row[0]) if row and row[0] else None

    def save(self, version: int, *, gate: dict[str, Any] | None = None, analysis: dict[str, Any] | None = None,
             tally: dict[str, Any] | None = None) -> None:
        """Keep a gate result, the live analysis or the measurement's tally with the candidate
        (not a transition)."""
        with self._txn():
            self._check_fence()
            if tally is not None:
                self.db.execute("UPDATE release_candidates SET tally=? WHERE version=?", (json.dumps(tally), version))
            if gate is not None:
                self.db.execute("UPDATE release_candidates SET gate=?, updated_at=? WHERE version=?",
                                (json.dumps(gate), time.time(), version))
            if analysis is not None:
                self.db.execute("UPDATE release_candidates SET analysis=?, updated_at=? WHERE version=?",
                                (json.dumps(analysis), time.time(), version))

    def transition(self, version: int, target: State, actor: str, reason: str,
                   evidence: dict[str, Any] | None = None, routing: Routing | BackToStable | None = None,
                   promotion_interval_s: float | None = None) -> bool:
        """Move ``version`` to ``target`` with its audit entry, and the new routing if any, in one
        transaction. False when it is already there (a no-op); ``TransitionRefused`` when the
        table does not allow it; ``KeyError`` for an unknown version."""
        now = time.time()
        with self._txn():
            self._check_fence(now)
            row = self.db.execute(f"SELECT state FROM release_candidates WHERE version=?{self.db.for_update}",
                                  (version,)).fetchone()
            if row is None:
                raise KeyError(f"no candidate version {version}")
            current = State(row[0])
            if not check(version, current, target):
                return False
            if target == State.PROMOTED and promotion_interval_s:
                # inside the transaction, so two promotions at one moment cannot both pass it
                last = self._get("last_promotion_at")
                if last is not None and now - float(last) < promotion_interval_s:
                    raise TransitionRefused(
                        f"a version was promoted {now - float(last):.0f}s ago: the next promotion is allowed in "
                        f"{promotion_interval_s - (now - float(last)):.0f}s (release.promotion_interval_s = "
                        f"{promotion_interval_s:.0f})")
            self.db.execute("UPDATE release_candidates SET state=?, updated_at=? WHERE version=?",
                            (target.value, now, version))
            if target in FINAL:  # measuring is over: the analysis keeps the verdict and its numbers
                self.db.execute("UPDATE release_candidates SET tally=NULL WHERE version=?", (version,))
            self._audit(version, current, target, actor, reason, evidence, now)
            if isinstance(routing, BackToStable):
                routing = self._back_to_stable(version, current)
            if routing is not None:
                self._route(routing, f"{target.value} v{version}: {reason}", now)
            if target == State.PROMOTED:
                self._set("last_promotion_at", str(now))
        return True

    def unroute_canary(self, actor: str, reason: str, version: int | None = None) -> int | None:
        """Send every user back to stable when the newest routing names a canary whose candidate
        is no longer live (a database written before the reject/gate race was fixed holds such a
        routing, and no transition can end it); the version it named, or None when there is no
        such canary (or not ``version``). One transaction: the revision and its audit entry."""
        now = time.time()
        with self._txn():
            self._check_fence(now)
            self._lock_revisions()
            rev = self.latest_revision()
            if rev is None or rev.canary_version is None or version not in (None, rev.canary_version):
                return None
            row = self.db.execute(f"SELECT state FROM release_candidates WHERE version=?{self.db.for_update}",
                                  (rev.canary_version,)).fetchone()
            if row is not None and State(row[0]) in LIVE:
                return None  # a live canary ends with its transition, not here
            was = f"v{rev.canary_version} is {row[0] if row else 'unknown'} but was still routed as canary"
            self._audit(rev.canary_version, None, None, actor, f"{reason} ({was})", None, now)
            self._route(Routing(rev.stable_version, None, 0.0), f"rolled back v{rev.canary_version}: {reason}", now)
            return rev.canary_version

    # -- routing ---------------------------------------------------------------------------
    def _back_to_stable(self, version: int, current: State) -> Routing | None:
        """:class:`BackToStable`, decided under the revisions lock (so no other routing change
        lands between this read and the new revision)."""
        self._lock_revisions()
        rev = self.latest_revision()
        if current not in LIVE and (rev is None or rev.canary_version != version):
            return None
        return Routing(rev.stable_version if rev else 0, None, 0.0)

    def _lock_revisions(self) -> None:
        if self.db.lock_revisions:
            self.db.execute(self.db.lock_revisions)

    def _route(self, routing: Routing, reason: str, now: float) -> None:
        self._lock_revisions()
        last = self.db.execute("SELECT max(revision) FROM release_revisions").fetchone()[0]
        self.db.execute("INSERT INTO release_revisions VALUES (?, ?, ?, ?, ?, ?, 0)",
                        ((last or 0) + 1, routing.stable_version, routing.canary_version,
                         routing.canary_share, reason[:2000], now))

    def latest_revision(self) -> Revision | None:
        row = self.db.execute("SELECT * FROM release_revisions ORDER BY revision DESC LIMIT 1").fetchone()
        return _revision(row) if row else None

    def unpublished(self) -> list[Revision]:
        rows = self.db.execute("SELECT * FROM release_revisions WHERE published=0 ORDER BY revision").fetchall()
        return [_revision(r) for r in rows]

    def mark_published(self, revisions: list[int]) -> None:
        with self._txn():
            for rev in revisions:
                self.db.execute("UPDATE release_revisions SET published=? WHERE revision=?", (PUBLISHED, rev))

    def skip_revision(self, revision: int, actor: str, reason: str) -> None:
        """Mark an unpublished revision as one that is never to be published (``reason`` says why,
        in the audit log): no record can be built from it. Serving applies only revisions above
        the last it applied, so the ones after it stand on their own."""
        with self._txn():
            self._check_fence()
            if self.db.execute("UPDATE release_revisions SET published=? WHERE revision=? AND published=0 "
                               "RETURNING revision", (SKIPPED, revision)).fetchall():
                self._audit(None, None, None, actor, reason, None, time.time())

    def newest_published(self) -> int | None:
        """The newest revision Kafka acknowledged on the releases topic (None: none yet)."""
        row = self.db.execute("SELECT max(revision) FROM release_revisions WHERE published=?", (PUBLISHED,)).fetchone()
        return row[0] if row and row[0] is not None else None

    def current_routing(self) -> Revision | None:
        """The newest revision Kafka acknowledged, whole: the routing serving should be on, which
        the controller sends again (None: none published yet)."""
        row = self.db.execute("SELECT * FROM release_revisions WHERE published=? ORDER BY revision DESC LIMIT 1",
                              (PUBLISHED,)).fetchone()
        return _revision(row) if row else None

    def undo(self, version: int, actor: str, reason: str) -> Revision:
        """Return stable to ``version``, a version promoted before (Argo Rollouts' ``undo``): a new
        revision routing every user to it, and its audit entry (evidence ``{"undo": {"from",
        "to"}}``), in one transaction. Refused (:class:`TransitionRefused`) for a version never
        promoted, the version already stable, or while a canary is live (roll it back first: an
        undo under a canary would change what the canary is compared with). Candidates' states
        do not change: the version stays promoted, and so does the one it replaces."""
        now = time.time()
        with self._txn():
            self._check_fence(now)
            self._lock_revisions()
            row = self.db.execute("SELECT state FROM release_candidates WHERE version=?", (version,)).fetchone()
            if row is None:
                raise TransitionRefused(f"no version {version} was ever published to this controller")
            if State(row[0]) != State.PROMOTED:
                raise TransitionRefused(f"version {version} is {row[0]}: only a version promoted before can be "
                                        "stable again")
            rev = self.latest_revision()
            stable = rev.stable_version if rev else 0
            if stable == version:
                raise TransitionRefused(f"version {version} is already stable")
            live = [c.version for c in self.candidates(set(LIVE))]
            if live or (rev and rev.canary_version is not None):
                raise TransitionRefused(f"a canary is live (v{live[0] if live else rev.canary_version}): roll it "
                                        "back first, then undo")
            self._audit(version, None, None, actor, f"undo: stable back to v{version} from v{stable}: {reason}",
                        {UNDO: {"from": stable, "to": version}}, now)
            self._route(Routing(version, None, 0.0), f"undo to v{version} from v{stable}: {reason}", now)
            return self.latest_revision()

    def keep_serving_stable(self, version: int, refused_revision: int, actor: str, reason: str,
                            evidence: dict[str, Any]) -> Revision | None:
        """Serving refused revision ``refused_revision``, which moved stable, and still serves
        ``version``: a new revision routing every user to ``version``, and its audit entry
        (evidence ``{"serving_refused": ...}``, filed under the version refused), in one
        transaction; the new revision. None when another routing was decided since the refused
        one (checked under the revisions lock): that newer decision is what serving acts on next.
        Candidates' states do not change, as with :meth:`undo`."""
        now = time.time()
        with self._txn():
            self._check_fence(now)
            self._lock_revisions()
            rev = self.latest_revision()
            if rev is None or rev.revision != refused_revision or rev.canary_version is not None:
                return None
            self._audit(rev.stable_version, None, None, actor, f"{reason}; stable stays v{version}, as serving serves",
                        evidence, now)
            self._route(Routing(version, None, 0.0), f"serving kept v{version}: {reason}", now)
            return self.latest_revision()

    def was_stable(self, version: int) -> bool:
        """Whether any routing of this store made ``version`` stable (version 0 always was)."""
        return version == 0 or self.db.execute(
            "SELECT 1 FROM release_revisions WHERE stable_version=? LIMIT 1", (version,)).fetchone() is not None

    def serving_status_offsets(self) -> dict[int, int] | None:
        """Where reading ``flywheel.serving-status`` resumes, per partition (None: never read)."""
        raw = self._get("serving_status_offsets")
        return None if raw is None else {int(p): int(o) for p, o in json.loads(raw).items()}

    def save_serving_status_offsets(self, offsets: dict[int, int]) -> None:
        """Saved once the statuses before them were acted on (each action its own transaction):
        a crash between the two reads them again, and :mod:`release.serving_state` acts once."""
        with self._txn():
            self._check_fence()
            self._set("serving_status_offsets", json.dumps({str(p): o for p, o in sorted(offsets.items())}))

    def stable_version(self) -> int:
        """The version stable users get: the newest revision's, or 0 (the model serving started on)."""
        rev = self.latest_revision()
        return rev.stable_version if rev else 0

    # -- pipeline and audit ----------------------------------------------------------------
    def paused(self) -> bool:
        return self._get("paused") == "1"

    def set_paused(self, paused: bool, actor: str, reason: str) -> bool:
        """Pause or resume the pipeline (audited); False when it already was."""
        now = time.time()
        with self._txn():
            if (self._get("paused") == "1") == paused:
                return False
            self._set("paused", "1" if paused else "0")
            self._audit(None, None, None, actor, ("paused: " if paused else "resumed: ") + reason, None, now)
        return True

    def canary_record(self) -> tuple[int, int]:
        """(canaries started, canaries whose analysis passed) in this database's whole history,
        read from the audit log, which every transition writes in its own transaction: the counts
        the budget across canaries is spent by (release/budget.py). A pass
        is ``canary -> awaiting_approval``, or ``canary -> promoted`` (only the auto-promote
        policy makes that one, on a passing analysis: release/states.py)."""
        row = self.db.execute(
            "SELECT sum(CASE WHEN to_state='canary' THEN 1 ELSE 0 END), "
            "sum(CASE WHEN from_state='canary' AND to_state IN ('awaiting_approval', 'promoted') THEN 1 ELSE 0 END) "
            "FROM release_audit WHERE to_state IN ('canary', 'awaiting_approval', 'promoted')").fetchone()
        return int(row[0] or 0), int(row[1] or 0)

    def canary_passes(self) -> list[bool]:
        """Every canary this database started, in the order they started: whether its analysis
        passed (as :meth:`canary_record` counts one). The budget across canaries reads its block of
        them (release/budget.py ``pass_level``)."""
        rows = self.db.execute(
            "SELECT version, from_state, to_state FROM release_audit "
            "WHERE to_state IN ('canary', 'awaiting_approval', 'promoted') ORDER BY id").fetchall()
        started: list[list[Any]] = []  # [version, passed], in start order
        for version, from_state, to_state in rows:
            if to_state == "canary":
                started.append([version, False])
            elif from_state == "canary":
                last = next((s for s in reversed(started) if s[0] == version), None)
                if last is not None:
                    last[1] = True
        return [passed for _, passed in started]

    def state_counts(self) -> dict[State, int]:
        """Candidates by state, counted in SQL (a long history is not parsed at every scrape)."""
        rows = self.db.execute("SELECT state, count(*) FROM release_candidates GROUP BY state").fetchall()
        return {State(r[0]): int(r[1]) for r in rows}

    def entered_at(self, version: int, state: State) -> float | None:
        """When ``version`` last entered ``state``, from the audit log (None: never)."""
        row = self.db.execute("SELECT max(at) FROM release_audit WHERE version=? AND to_state=?",
                              (version, state.value)).fetchone()
        return row[0] if row and row[0] is not None else None

    def last_promotion_at(self) -> float | None:
        value = self._get("last_promotion_at")
        return float(value) if value is not None else None

    def note(self, version: int | None, actor: str, reason: str, evidence: dict[str, Any] | None = None) -> None:
        """An audit entry that changes no state (a refused approval, a gate that errored)."""
        with self._txn():
            self._audit(version, None, None, actor, reason, evidence, time.time())

    def audit(self, version: int | None = None, limit: int = 200) -> list[AuditEntry]:
        if version is None:
            rows = self.db.execute("SELECT * FROM release_audit ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        else:
            rows = self.db.execute("SELECT * FROM release_audit WHERE version=? ORDER BY id DESC LIMIT ?",
                                   (version, limit)).fetchall()
        return [AuditEntry(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]) if r[6] else None, r[7])
                for r in rows]

    # -- the controller lease --------------------------------------------------------------
    def take_lease(self, holder: str, ttl_s: float, name: str = "controller") -> bool:
        """Hold (or renew) the lease for ``ttl_s``; False while another holder's has not lapsed."""
        now = time.time()
        look = f"SELECT holder, expires_at FROM release_lease WHERE name=?{self.db.for_update}"
        with self._txn():
            row = self.db.execute(look, (name,)).fetchone()
            if row is None:
                # Two controllers starting together both find no row, and on PostgreSQL there is
                # no row to lock yet: insert only if it is still missing, else judge the lease
                # the other one just took (a plain INSERT failed here with a duplicate key).
                if self.db.execute("INSERT INTO release_lease VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING "
                                   "RETURNING name", (name, holder, now + ttl_s)).fetchall():
                    return True
                row = self.db.execute(look, (name,)).fetchone()
            if row[0] != holder and row[1] > now:
                return False
            self.db.execute("UPDATE release_lease SET holder=?, expires_at=? WHERE name=?", (holder, now + ttl_s, name))
            if row[0] != holder:
                self._audit(None, None, None, controller_actor(holder),
                            f"took over the controller lease from {row[0]} (lapsed)", None, now)
        return True

    def lease_holder(self, name: str = "controller") -> tuple[str, float] | None:
        row = self.db.execute("SELECT holder, expires_at FROM release_lease WHERE name=?", (name,)).fetchone()
        return (row[0], row[1]) if row else None

    # -- helpers ---------------------------------------------------------------------------
    def _check_fence(self, now: float | None = None, name: str = "controller") -> None:
        if self.fence is None:
            return
        row = self.db.execute(f"SELECT holder, expires_at FROM release_lease WHERE name=?{self.db.for_update}",
                              (name,)).fetchone()
        if row is None or row[0] != self.fence or row[1] < (now or time.time()):
            raise LeaseLost(f"{self.fence} no longer holds the controller lease"
                            + (f" ({row[0]} does)" if row and row[0] != self.fence else " (it lapsed)"))

    def _audit(self, version: int | None, frm: State | None, to: State | None, actor: str, reason: str,
               evidence: dict[str, Any] | None, at: float) -> None:
        row = self.db.execute(
            "INSERT INTO release_audit (version, from_state, to_state, actor, reason, evidence, at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (version, frm.value if frm else None, to.value if to else None, actor, reason,
             json.dumps(evidence) if evidence is not None else None, at)).fetchone()
        self._written.append(AuditEntry(int(row[0]), version, frm.value if frm else None, to.value if to else None,
                                        actor, reason, evidence, at))

    def _get(self, key: str) -> str | None:
        row = self.db.execute("SELECT v FROM release_meta WHERE k=?", (key,)).fetchone()
        return row[0] if row else None

    def _set(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO release_meta VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v=excluded.v",
                        (key, value))


#: Every column of a candidate but its tally (read alone, by the controller only).
_COLUMNS = "version, parent, state, uri, manifest_sha256, checkpoint, gate, analysis, created_at, updated_at"


def _candidate(r: Any) -> Candidate:
    return Candidate(r[0], r[1], State(r[2]), r[3], r[4], json.loads(r[5]),
                     json.loads(r[6]) if r[6] else None, json.loads(r[7]) if r[7] else None, r[8], r[9])


def _revision(r: Any) -> Revision:
    return Revision(r[0], r[1], r[2], r[3], r[4], r[5], r[6] == PUBLISHED, r[6] == SKIPPED)


__all__ = ["AUTO_POLICY", "FINAL", "SERVING_REFUSED", "UNDO", "ActorKind", "AuditEntry", "BackToStable", "Candidate", "LeaseLost", "ReleaseStore", "Revision", "Routing", "actor_kind",
           "controller_actor", "database_url"]
