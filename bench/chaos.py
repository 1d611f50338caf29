"""The whole-loop fault run: ``flywheel up`` and simulated users for minutes, with faults injected
across every role, then the invariants checked from what the run left.

    python bench/chaos.py --out chaos.json                  # 10 minutes, at least 50 faults
    python bench/chaos.py --duration 300 --out chaos.json   # the short form (the slow test's)
    flywheel chaos --duration 600 --seed 3 --out chaos.json

The loop runs with the demo's settings (``local/demo.toml``) under ``flywheel up --replicas 2``:
two processes each of ingest and reward sharing their stage's partitions, its state and one
archive root, in a throwaway PostgreSQL database made for the run on ``--pg-url``'s server
(``flywheel_chaos_<random>``, dropped at the end) that also holds the release store.
``--stream-db sqlite`` keeps the stream state in SQLite files the replicas share, ``--stream-db
local`` in each process's own store (one process a stage); ``--pg-url ''`` keeps every store on
SQLite and drops the database fault.
While the users are simulated (``flywheel simulate``'s population), faults land at random times
drawn from ``--seed``, each kind spread over the run (one at a random moment of each equal slice),
each logged with its time:

- ``kill:<role>``: SIGKILL of serving, ingest, reward, the trainer or the release controller, by
  the pid ``flywheel up``'s status names (of ingest and reward, a random live replica). ``up``
  restarts it; the time until its ``/readyz`` answers 200 again is its recovery. Of a stream
  stage's replica that held partitions, the time until the ``/health`` ``shards`` of the
  stage's live replicas cover every partition again is the takeover.
  Every process of the killed instance (serving's vLLM engines above all) is read from ``/proc``
  before the kill and must be gone within :data:`ORPHAN_WAIT_S`.
- ``broker_stop``: SIGSTOP of the embedded broker for 5-30 s, then SIGCONT.
- ``pg_drop``: every connection of the loop to PostgreSQL (the release controller's and the
  stream stages') ended by ``pg_terminate_backend``, which is what a database restart or a
  failover looks like to a client. The server itself is shared with other users of the machine
  and is not restarted. A stream stage whose connection died exits and ``up`` restarts it: the
  fault's outcome names the replicas that restarted within :data:`PG_DROP_WATCH_S`.
- ``store_unreadable``: the checkpoint store's directory ``chmod 000`` for 10-30 s, then restored.
  ``up`` runs without CAP_DAC_OVERRIDE (``setpriv``) when this runs as root, so the mode binds.
- ``malformed:<topic>``: six malformed records (empty, not UTF-8, not an object, the wrong kind,
  an unknown schema version, invalid fields) on each topic a role consumes, written with a raw
  kafka-python producer under keys of their own.

After the traffic, the loop runs on until every judged generation is accounted for (at most
``--settle``), then the run reads the topics through flywheel/contracts.py, the release store,
the trainer's ledgers and the process table, and judges (bench/chaos_judge.py):

- every judged generation became exactly one distinct reward, or a dead letter with its reason;
- no version trained on a sample twice; every version users were served had been verified;
- the release store and the last published routing agree;
- users were answered throughout, apart from serving's own restarts;
- no process outlived the role that started it; every malformed record was dead-lettered;
- the loop still learns: the last promoted version's accept rate is at least v0's.

It prints a table and writes JSON (``--out``); the exit status is 1 when any invariant broke.
Not part of ``flywheel bench``: it takes the whole duration plus start and settle (~15 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import chaos_judge as judge

#: Faults of each kind per 10 minutes of traffic (at least one of each whatever the duration),
#: and rounds of malformed records (each round: every input topic once). 51 at 10 minutes, 26 at 5.
#: Serving is killed least: its restart (two vLLM engines warmed) takes a minute on two cores, and
#: users are unanswered meanwhile.
PER_10_MIN = {"kill:serve": 2, "kill:ingest": 7, "kill:reward": 6, "kill:train": 4, "kill:release": 6,
              "broker_stop": 4, "pg_drop": 5, "store_unreadable": 3}
MALFORMED_ROUNDS_PER_10_MIN = 2
#: The topics each role consumes: the malformed records' targets (``Topics`` attribute -> role).
INPUT_TOPICS = {"generations": "ingest", "feedback": "ingest", "episodes": "reward", "rewards": "train",
                "checkpoints": "release", "serving_status": "release", "releases": "serve"}
KIND_OF_TOPIC = {"generations": "generation", "feedback": "feedback", "episodes": "episode", "rewards": "reward",
                 "checkpoints": "checkpoint", "serving_status": "serving_status", "releases": "release"}
#: No fault in the first LEAD_S of traffic (the loop's first turns), none in the last TAIL_S (what
#: it broke is recovered from before the users stop). Serving is killed only between these shares
#: of the run: before, the loop has had traffic to learn from (a restart with the users unanswered
#: took 108 s on two cores at load 10, 315 s at load 28: a kill early in a 5-minute run left no
#: traffic to promote a version on); after, it has time to come back before the users stop.
LEAD_S, TAIL_S = 15.0, 30.0
SERVE_KILLS_BETWEEN = (0.5, 0.8)
#: Seconds within which every process of a killed instance must be gone from the process table.
ORPHAN_WAIT_S = 10.0
#: Longest wait for a killed role to answer /readyz again (serving took 315 s on a loaded machine).
RECOVERY_WAIT_S = 600.0
#: Longest wait for a stream stage's live replicas to cover every partition after a kill.
TAKEOVER_WAIT_S = 180.0
#: Seconds after a ``pg_drop`` within which a stream stage replica's restart is put down to it.
PG_DROP_WATCH_S = 20.0
#: The stages ``flywheel up --replicas`` runs several processes of (local/up.py REPLICATED).
STREAM_ROLES = ("ingest", "reward")


def _say(msg: str) -> None:
    print(f"[chaos] {msg}", flush=True)


@dataclass
class Fault:
    at: float  # seconds after traffic started
    kind: str
    seconds: float = 0.0  # how long a stall or an unreadable store lasts
    done_at: float | None = None  # epoch seconds it happened (None: it could not)
    outcome: dict[str, Any] = field(default_factory=dict)


def plan(duration_s: float, seed: int) -> list[Fault]:
    """Every fault of a run, in time order: each kind's faults one in each equal slice of its window."""
    rng = random.Random(seed)
    scale = duration_s / 600.0
    counts = {k: max(1, round(n * scale)) for k, n in PER_10_MIN.items()}
    rounds = max(1, round(MALFORMED_ROUNDS_PER_10_MIN * scale))
    counts.update({f"malformed:{t}": rounds for t in INPUT_TOPICS})
    faults = []
    for kind, n in counts.items():
        start, end = LEAD_S, duration_s - TAIL_S
        if kind == "kill:serve":
            start, end = (duration_s * share for share in SERVE_KILLS_BETWEEN)
        start = min(start, end)
        width = (end - start) / n
        for i in range(n):
            seconds = rng.uniform(5, 30) if kind == "broker_stop" else rng.uniform(10, 30) \
                if kind == "store_unreadable" else 0.0
            faults.append(Fault(start + width * (i + rng.random()), kind, round(seconds, 1)))
    return sorted(faults, key=lambda f: f.at)


# -- the process table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot: tells a pid reused by another process apart
    cmd: str


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, None when gone."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def _cmd(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_of(pid: int) -> Proc | None:
    s = _stat(pid)
    return None if s is None else Proc(pid, s[2], _cmd(pid))


def descendants(pid: int) -> list[Proc]:
    """Every live process under ``pid`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            children.setdefault(s[1], []).append(int(entry.name))
    out, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        if (proc := proc_of(p)) is not None:
            out.append(proc)
        todo.extend(children.get(p, ()))
    return out


def alive(proc: Proc) -> bool:
    s = _stat(proc.pid)
    return s is not None and s[0] not in ("Z", "X") and s[2] == proc.start


# -- the loop under test ---------------------------------------------------------------------------
class Loop:
    """``flywheel up`` started for the run: its ports, status file and pids."""

    def __init__(self, root: Path, model_dir: Path, db: RunDatabase | None, stream_url: str,
                 replicas: int) -> None:
        from local.broker import free_port
        from local.up import STAGES, status_path

        self.root, self.model_dir, self.db, self.replicas = root, model_dir, db, replicas
        self.stream_on_pg = stream_url.startswith("postgres")
        self.key, self.token = "sk-chaos-" + secrets.token_hex(8), secrets.token_hex(12)
        self.ports = {name: free_port() for name, _, _ in STAGES}
        self.status_file = status_path(root)
        self.config = ROOT / "local" / "demo.toml"
        self.env = dict(os.environ, FLYWHEEL_CONFIG=str(self.config), FLYWHEEL_DATA_DIR=str(root),
                        FLYWHEEL_MODEL_DIR=str(model_dir), FLYWHEEL_API_KEYS=self.key,
                        FLYWHEEL_RELEASE_TOKENS=f"chaos:admin:{self.token}",
                        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                        **{var: str(self.ports[name]) for name, _, var in STAGES})
        if db is not None:
            self.env["FLYWHEEL_DATABASE_URL"] = db.release_url
        if stream_url:
            self.env["FLYWHEEL_STREAM_DATABASE_URL"] = stream_url
        self.proc: subprocess.Popen | None = None
        #: whether ``up`` runs without CAP_DAC_OVERRIDE, so a chmod binds it (always, as non-root)
        self.mode_binds = os.geteuid() != 0

    def start(self, timeout_s: float) -> None:
        from local.demo import _wait_healthy

        argv = [sys.executable, "-m", "cli", "up", "--replicas", str(self.replicas)]
        if os.geteuid() == 0 and shutil.which("setpriv"):
            drop = "-dac_override,-dac_read_search"
            argv = ["setpriv", "--bounding-set", drop, "--inh-caps", drop, "--", *argv]
            self.mode_binds = True
        log = self.root / "up.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait_healthy(self.url("serve"), self.proc, log, timeout_s=timeout_s)

    def stop(self) -> None:
        from local.demo import _stop

        if self.proc is not None:
            _stop(self.proc)

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def status(self) -> dict[str, Any]:
        return json.loads(self.status_file.read_text())

    def instances(self, role: str) -> list[dict[str, Any]]:
        """``role``'s processes in ``up``'s status: itself, or its replicas ``<role>-<n>``."""
        return [s for s in self.status()["stages"] if replica_of(s["name"]) == role]

    def pids(self, role: str) -> list[int]:
        """The live pids of ``role``, one per replica."""
        return [s["pid"] for s in self.instances(role) if s["pid"]]

    def pid_of(self, name: str) -> int | None:
        return next((s["pid"] for s in self.status()["stages"] if s["name"] == name), None)

    def broker_pid(self) -> int:
        return self.status()["broker"]["pid"]

    def ready(self, role: str, port: int | None = None) -> bool:
        return _get(f"http://127.0.0.1:{port or self.ports[role]}/readyz") is not None

    def shards(self, port: int) -> list[int] | None:
        """The partitions a stream stage's process owns, from its ``/health``; None: no answer."""
        h = _get(f"http://127.0.0.1:{port}/health")
        return None if h is None else list(h.get("shards") or [])


def replica_of(name: str) -> str:
    """The role a process of ``up``'s status runs: ``ingest-2`` -> ``ingest``."""
    role, _, n = name.rpartition("-")
    return role if role and n.isdigit() else name


def _get(url: str) -> dict[str, Any] | None:
    """The JSON of a 200 answer, None for any other answer or none."""
    import httpx

    try:
        r = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return {}


# -- faults -----------------------------------------------------------------------------------------
class Injector:
    def __init__(self, loop: Loop, settings: Any, rng: random.Random, faults: list[Fault]) -> None:
        self.loop, self.settings, self.rng, self.faults = loop, settings, rng, faults
        self.threads: list[threading.Thread] = []
        self.seen: list[Proc] = []  # every process of every killed instance
        self.injected: list[tuple[str, str]] = []  # (topic, key) of each malformed record
        self.restarts: list[tuple[float, float]] = []  # serving's: kill to ready again
        self._stalled = threading.Lock()  # one broker stall at a time: two would overlap their SIGCONTs
        self._restore: list[Any] = []

    def start(self, fault: Fault, started: float) -> None:
        """Inject ``fault`` on a thread of its own, so that one held up (a record sent while the
        broker is stopped waits for it) does not hold the next one back, and log it."""

        def inject() -> None:
            self.run(fault)
            _say(f"t={time.time() - started:5.1f}s {fault.kind} {json.dumps(fault.outcome)}")

        self._later(inject)

    def run(self, fault: Fault) -> None:
        kind = fault.kind
        if kind.startswith("kill:"):
            self._kill(fault, kind.split(":", 1)[1])
        elif kind == "broker_stop":
            self._broker_stop(fault)
        elif kind == "pg_drop":
            self._pg_drop(fault)
        elif kind == "store_unreadable":
            self._store_unreadable(fault)
        elif kind.startswith("malformed:"):
            self._malformed(fault, kind.split(":", 1)[1])

    def _later(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _kill(self, fault: Fault, role: str) -> None:
        deadline = time.monotonic() + 30
        while not (live := [s for s in self.loop.instances(role) if s["pid"]]):  # restarting from an earlier fault
            if time.monotonic() > deadline:
                fault.outcome = {"skipped": f"{role} had no live process for 30 s"}
                return
            time.sleep(1)
        victim = self.rng.choice(live)
        pid, port = victim["pid"], victim["port"]
        # the partitions the victim held, read just before the kill: those a takeover moves
        held = self.loop.shards(port) if role in STREAM_ROLES else None
        leader, family = proc_of(pid), descendants(pid)
        os.kill(pid, signal.SIGKILL)
        fault.done_at = time.time()
        fault.outcome = {"name": victim["name"], "pid": pid, "processes": {p.pid: p.cmd[:80] for p in family},
                         "engines": [p.pid for p in family if "VLLM" in p.cmd]}
        if role in STREAM_ROLES:
            fault.outcome["shards"] = held
            if held:
                self._later(self._takeover, fault, role, port)
        self.seen.extend([leader, *family] if leader else family)
        self._later(self._watch, fault, role, victim["name"], pid, port, family)

    def _takeover(self, fault: Fault, role: str, dead_port: int) -> None:
        """Seconds from the kill until the stage's live replicas own every partition again (the
        killed one's replacement on its port counts once it answers: it joined the group)."""
        t0, want = fault.done_at, list(range(self.settings.kafka.partitions))
        while time.time() - t0 < TAKEOVER_WAIT_S:
            owned: list[int] = []
            for s in self.loop.instances(role):
                if s["pid"] and (shards := self.loop.shards(s["port"])) is not None:
                    owned += shards
            if sorted(owned) == want:
                fault.outcome["takeover_s"] = round(time.time() - t0, 2)
                return
            time.sleep(0.1)
        fault.outcome["takeover_s"] = None

    def _watch(self, fault: Fault, role: str, name: str, pid: int, port: int, family: list[Proc]) -> None:
        """How long the killed instance's processes lived on, and until it was ready again."""
        t0 = fault.done_at
        left = list(family)
        while left and time.time() - t0 < ORPHAN_WAIT_S:
            left = [p for p in left if alive(p)]
            time.sleep(0.05)
        fault.outcome["left_running"] = [asdict(p) for p in left if alive(p)]
        fault.outcome["family_gone_s"] = None if left else round(time.time() - t0, 2)
        while time.time() - t0 < RECOVERY_WAIT_S:
            if (now := self.loop.pid_of(name)) and now != pid and self.loop.ready(role, port):
                fault.outcome["recovered_s"] = round(time.time() - t0, 1)
                break
            time.sleep(0.25)
        if role == "serve":
            self.restarts.append((t0, t0 + fault.outcome.get("recovered_s", RECOVERY_WAIT_S)))

    def _broker_stop(self, fault: Fault) -> None:
        if not self._stalled.acquire(timeout=60):
            fault.outcome = {"skipped": "a stall was still on for 60 s"}
            return
        pid = self.loop.broker_pid()
        os.kill(pid, signal.SIGSTOP)
        fault.done_at = time.time()
        fault.outcome = {"pid": pid}
        resume = lambda: os.kill(pid, signal.SIGCONT)
        self._restore.append(resume)

        def later() -> None:
            time.sleep(fault.seconds)
            resume()
            self._restore.remove(resume)
            self._stalled.release()

        self._later(later)

    def _pg_drop(self, fault: Fault) -> None:
        import psycopg

        db = self.loop.db
        if db is None:
            fault.outcome = {"skipped": "every store is SQLite (--pg-url '')"}
            return
        deadline = time.monotonic() + 30
        with psycopg.connect(db.admin_url, autocommit=True, connect_timeout=5) as admin:
            # none while the controller restarts from an earlier kill: the fault waits for one
            while True:
                before = self._stream_restarts()
                # the call in the select list: a WHERE clause may evaluate it before the filter,
                # ending every connection on the server (other users' and this one)
                ended = [(app,) for app, ok in admin.execute(
                    "SELECT application_name, pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()", (db.name,)).fetchall() if ok]
                if ended or time.monotonic() > deadline:
                    break
                time.sleep(1)
        if not ended:
            fault.outcome = {"skipped": "the loop held no connection to PostgreSQL for 30 s"}
            return
        fault.done_at = time.time()
        by_app: dict[str, int] = {}
        for (app,) in ended:
            by_app[app or "?"] = by_app.get(app or "?", 0) + 1
        fault.outcome = {"backends_terminated": len(ended), "by_application": by_app}
        if self.loop.stream_on_pg:
            self._later(self._after_pg_drop, fault, before)

    def _stream_restarts(self) -> dict[str, int]:
        return {s["name"]: s["restarts"] for role in STREAM_ROLES for s in self.loop.instances(role)}

    def _after_pg_drop(self, fault: Fault, before: dict[str, int]) -> None:
        """The stream replicas ``up`` restarted within :data:`PG_DROP_WATCH_S` of the drop, and
        those a kill fault hit meanwhile (whose restart is the kill's)."""
        time.sleep(PG_DROP_WATCH_S)
        after = self._stream_restarts()
        fault.outcome["stream_restarted"] = sorted(n for n, r in after.items() if r > before.get(n, r))
        fault.outcome["killed_meanwhile"] = sorted(
            f.outcome.get("name") for f in self.faults if f.kind.startswith("kill:") and f.done_at
            and 0 <= f.done_at - fault.done_at <= PG_DROP_WATCH_S and f.outcome.get("name"))

    def _store_unreadable(self, fault: Fault) -> None:
        from flywheel.checkpoints.store import store_root

        if not self.loop.mode_binds:
            fault.outcome = {"skipped": "running as root without setpriv: a mode does not bind"}
            return
        store = store_root(self.settings)
        mode = store.stat().st_mode & 0o7777
        store.chmod(0)
        fault.done_at = time.time()
        fault.outcome = {"path": str(store)}
        restore = lambda: store.chmod(mode)
        self._restore.append(restore)

        def later() -> None:
            time.sleep(fault.seconds)
            restore()
            self._restore.remove(restore)

        self._later(later)

    def _malformed(self, fault: Fault, attr: str) -> None:
        from kafka import KafkaProducer

        from flywheel.contracts import Topics

        topic = getattr(Topics(self.settings.topic_prefix), attr)
        kind = KIND_OF_TOPIC[attr]
        other = "feedback" if kind != "feedback" else "generation"
        tag = uuid.uuid4().hex[:8]
        values = [b"", b"\xff\xfe chaos: not UTF-8", b"[1, 2, 3]",
                  json.dumps({"kind": other, "schema_version": 1}).encode(),
                  json.dumps({"kind": kind, "schema_version": 99}).encode(),
                  json.dumps({"kind": kind, "schema_version": 1, "chaos": tag}).encode()]
        producer = KafkaProducer(bootstrap_servers=self.loop.status()["broker"]["bootstrap"], acks="all",
                                 max_block_ms=60_000)
        try:
            keys = [f"chaos-{tag}-{i}" for i in range(len(values))]
            for key, value in zip(keys, values, strict=True):
                producer.send(topic, key=key.encode(), value=value)
            producer.flush(timeout=90)
        finally:
            producer.close(timeout=5)
        self.injected.extend((topic, k) for k in keys)
        fault.done_at = time.time()
        fault.outcome = {"topic": topic, "records": len(values)}

    def finish(self) -> None:
        deadline = time.monotonic() + RECOVERY_WAIT_S + 60
        while (pending := [t for t in list(self.threads) if t.is_alive()]) and time.monotonic() < deadline:
            pending[0].join(timeout=1)
        for restore in list(self._restore):  # a run stopped early leaves no broker stopped, no store closed
            restore()


@dataclass(frozen=True)
class RunDatabase:
    """The run's own PostgreSQL database: the release store's and the stream stages' state."""

    admin_url: str  # the server's maintenance database, which creates and drops it
    name: str

    def url(self, app: str) -> str:
        """The database's URL, its connections named ``app`` in ``pg_stat_activity``."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(self.admin_url)
        return urlunsplit((parts.scheme, parts.netloc, f"/{self.name}", f"application_name={app}", ""))

    @property
    def release_url(self) -> str:
        return self.url("flywheel-release")

    @property
    def stream_url(self) -> str:
        return self.url("flywheel-stream")


def create_database(admin_url: str) -> RunDatabase:
    """A fresh database ``flywheel_chaos_<random>`` on ``admin_url``'s server."""
    import psycopg

    db = RunDatabase(admin_url, f"flywheel_chaos_{uuid.uuid4().hex[:12]}")
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'CREATE DATABASE "{db.name}"')
    except psycopg.OperationalError as exc:
        raise SystemExit(f"chaos: no PostgreSQL at {admin_url} ({exc}); --pg-url '' runs every store on "
                         "SQLite, without the database fault") from None
    return db


def drop_database(db: RunDatabase) -> None:
    import psycopg

    with psycopg.connect(db.admin_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{db.name}" WITH (FORCE)')


# -- what the run left ------------------------------------------------------------------------------
def read_topic(kafka: Any, topics: Any, topic: str) -> list[Any]:
    from kafka import TopicPartition

    from flywheel.kafka.clients import read_to_end
    from flywheel.topology import declared_partitions

    starts = {TopicPartition(topic, p): None for p in range(declared_partitions(topic, topics, kafka))}
    return [rec for _, rec in read_to_end(kafka, starts, client_id="chaos-reader")]


def about(dl: Any) -> str | None:
    """The generation a dead letter is about: the id in the record it quotes, else its key."""
    import base64

    from flywheel.contracts import (
        ContractError,
        EpisodeEvent,
        FeedbackEvent,
        GenerationEvent,
        RewardEvent,
        decode,
    )

    raw = base64.b64decode(dl.value_b64) if dl.value_b64 else b""
    for cls in (FeedbackEvent, GenerationEvent, EpisodeEvent, RewardEvent):
        try:
            return decode(cls, raw, max_bytes=len(raw) + 1).generation_id
        except ContractError:
            continue
    return base64.b64decode(dl.key_b64).decode(errors="replace") if dl.key_b64 else None


@dataclass
class Records:
    rewards: dict[str, set[bytes]]
    dead: dict[str, set[str]]
    dead_keys: set[tuple[str, str]]
    #: generation id -> each dead letter about it, as ``stage:reason: detail``
    details: dict[str, list[str]]


def read_accounting(kafka: Any, topics: Any) -> Records:
    import base64

    from flywheel.contracts import DeadLetterEvent, RewardEvent, decode

    rewards: dict[str, set[bytes]] = {}
    for rec in read_topic(kafka, topics, topics.rewards):
        try:
            gid = decode(RewardEvent, rec.value).generation_id
        except ValueError:
            continue  # a malformed one of ours: the trainer's dead letter accounts for it
        rewards.setdefault(gid, set()).add(rec.value)
    dead: dict[str, set[str]] = {}
    dead_keys, details = set(), {}
    for rec in read_topic(kafka, topics, topics.deadletter):
        dl = decode(DeadLetterEvent, rec.value, max_bytes=len(rec.value) + 1)
        if dl.key_b64:
            dead_keys.add((dl.source_topic, base64.b64decode(dl.key_b64).decode(errors="replace")))
        if (gid := about(dl)) is not None:
            dead.setdefault(gid, set()).add(f"{dl.stage}:{dl.reason}")
            details.setdefault(gid, []).append(f"{dl.stage}:{dl.reason}: {dl.detail[:200]}")
    return Records(rewards, dead, dead_keys, details)


def judged_ids(rows: list[dict[str, Any]]) -> list[str]:
    """Generations a user judged: answered, and the feedback taken (202)."""
    return [r["generation_id"] for r in rows if r["status"] == 200 and r["signal"] and r["feedback_at"]]


def settle(kafka: Any, topics: Any, judged: list[str], settle_s: float) -> Records:
    """Read until every judged generation is accounted for, or ``settle_s`` passed."""
    deadline = time.monotonic() + settle_s
    while True:
        recs = read_accounting(kafka, topics)
        lost = [g for g in judged if not recs.rewards.get(g) and not recs.dead.get(g)]
        if not lost or time.monotonic() > deadline:
            return recs
        _say(f"settling: {len(lost)} judged generations not yet rewarded or dead-lettered")
        time.sleep(10)


def served_versions(kafka: Any, topics: Any, rows: list[dict[str, Any]]) -> dict[int, float]:
    """Version -> when it first answered a user: the generations topic (each version that
    sampled a token), serving's applied reports and the users' own answers."""
    from flywheel.contracts import GenerationEvent, ServingStatusEvent, decode

    first: dict[int, float] = {}

    def note(v: int | None, at: float) -> None:
        if v is not None:
            first[v] = min(first.get(v, at), at)

    for rec in read_topic(kafka, topics, topics.generations):
        try:
            g = decode(GenerationEvent, rec.value)
        except ValueError:
            continue
        note(g.model_version, g.created_at)
        for span in g.version_spans:
            note(span.version, g.created_at)
    for rec in read_topic(kafka, topics, topics.serving_status):
        try:
            s = decode(ServingStatusEvent, rec.value)
        except ValueError:
            continue
        if s.outcome == "applied":
            note(s.stable_version, s.at)
            note(s.canary_version, s.at)
    for r in rows:
        if r["status"] == 200:
            note(r["version"], r["at"])
    return first


def routing_facts(kafka: Any, topics: Any, store: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                                 dict[int, float], dict[int, str]]:
    """(the store's newest revision, the topic's last routing, version -> first routed at,
    version -> manifest its checkpoint record announced)."""
    from flywheel.contracts import CheckpointEvent, ReleaseEvent, decode

    last, routed = None, {}
    for rec in read_topic(kafka, topics, topics.releases):
        try:
            ev = decode(ReleaseEvent, rec.value)
        except ValueError:
            continue
        if last is None or ev.revision > last.revision:
            last = ev
        for v in (ev.stable_version, ev.canary_version):
            if v is not None:
                routed[v] = min(routed.get(v, ev.updated_at), ev.updated_at)
    announced = {}
    for rec in read_topic(kafka, topics, topics.checkpoints):
        try:
            ck = decode(CheckpointEvent, rec.value)
        except ValueError:
            continue
        announced.setdefault(ck.version, ck.manifest_sha256)
    rev = store.latest_revision()
    return (None if rev is None else asdict(rev), None if last is None else last.model_dump(), routed, announced)


def check_versions(served: dict[int, float], routed: dict[int, float], announced: dict[int, str],
                   store: Any, ckpts: Any) -> list[judge.VersionCheck]:
    from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError, sha256_file

    out = []
    gated = {e.version for e in store.audit(limit=100_000) if e.to_state == "canary"}
    for v, at in sorted(served.items()):
        path = ckpts.path(v) / MANIFEST_NAME
        cand = store.get(v)
        chain_error = None
        if v > 0 and path.exists():
            try:
                ckpts.materialize_bytes(v)
            except (ManifestError, OSError) as exc:
                chain_error = str(exc)[:300]
        out.append(judge.VersionCheck(v, at, sha256_file(path) if path.exists() else None, announced.get(v),
                                      cand.manifest_sha256 if cand else None, v in gated, routed.get(v),
                                      chain_error))
    return out


def ledgers(ckpts: Any) -> dict[int, list[str]]:
    out = {}
    for v in ckpts.versions():
        try:
            out[v] = list(ckpts.ledger(v)["trained"])
        except (OSError, ValueError, KeyError):
            out[v] = []  # version 0 (the model directory) trained on nothing
    return out


def last_promoted(store: Any) -> int | None:
    promoted = [e for e in store.audit(limit=100_000) if e.to_state == "promoted"]
    return max(promoted, key=lambda e: e.at).version if promoted else None


# -- the run ----------------------------------------------------------------------------------------
@dataclass
class Facts:
    """What the run read from the loop while it still ran (its topics live in the broker's memory)."""

    started: float
    ended: float
    rows: list[dict[str, Any]]
    judged: list[str]
    recs: Records
    served: dict[int, float]
    store_rev: dict[str, Any] | None
    topic_rev: dict[str, Any] | None
    routed: dict[int, float]
    announced: dict[int, str]


def exercise(loop: Loop, inj: Injector, faults: list[Fault], settings: Any, args: argparse.Namespace) -> Facts:
    """Start the loop, run the users with the faults, settle, and read the topics."""
    from flywheel.contracts import Topics
    from local.simulate import Config, Simulator
    from release.store import ReleaseStore, database_url

    t_start = time.monotonic()
    loop.start(args.start_timeout)
    _say(f"serving ready after {time.monotonic() - t_start:.0f} s; {args.duration:.0f} s of users at {args.rate:g}/s")
    kafka = settings.kafka.model_copy(update={"bootstrap": loop.status()["broker"]["bootstrap"]})
    topics = Topics(settings.topic_prefix)
    sim = Simulator(Config(url=loop.url("serve"), key=loop.key, duration_s=args.duration, rate=args.rate,
                           users=args.users, seed=args.seed))
    users = threading.Thread(target=sim.run, daemon=True)
    started = time.time()
    users.start()
    for f in faults:
        time.sleep(max(0.0, started + f.at - time.time()))
        inj.start(f, started)
    users.join()
    ended = time.time()
    inj.finish()
    rows = [asdict(r) for r in sim.rows]
    (loop.root / "simulate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judged = judged_ids(rows)
    _say(f"traffic over: {len(rows)} requests, {len(judged)} judged; settling (at most {args.settle:.0f} s)")
    recs = settle(kafka, topics, judged, args.settle)
    store = ReleaseStore(database_url(settings.release.database_url, loop.root))
    try:
        store_rev, topic_rev, routed, announced = routing_facts(kafka, topics, store)
    finally:
        store.close()
    return Facts(started, ended, rows, judged, recs, served_versions(kafka, topics, rows), store_rev, topic_rev,
                 routed, announced)


def verdict(facts: Facts, settings: Any, inj: Injector,
            faults: list[Fault]) -> tuple[list[judge.Invariant], dict[str, Any]]:
    """Every invariant, from the facts read while the loop ran and what it left once stopped; and
    the numbers behind them (accounting counts, accept rate by version, the last promoted)."""
    from flywheel.checkpoints.store import CheckpointStore, store_root
    from local.simulate import Row, summarise
    from release.store import ReleaseStore, database_url

    procs_at_end = [asdict(p) for p in inj.seen if alive(p)]
    ckpts = CheckpointStore(store_root(settings))
    store = ReleaseStore(database_url(settings.release.database_url, inj.loop.root))
    try:
        checks = check_versions(facts.served, facts.routed, facts.announced, store, ckpts)
        promoted = last_promoted(store)
    finally:
        store.close()
    accept = summarise([Row(**r) for r in facts.rows])["versions"]
    lost, double, counts = judge.judged_accounted(facts.judged, facts.recs.rewards, facts.recs.dead)
    orphaned = [p for f in faults for p in f.outcome.get("left_running", [])] + \
               [{**p, "at": "after flywheel up stopped"} for p in procs_at_end]
    invariants = [lost, double, judge.double_trained(ledgers(ckpts)), judge.unverified(checks),
                  judge.routing_agrees(facts.store_rev, facts.topic_rev), judge.unanswered(facts.rows, inj.restarts),
                  judge.orphans(orphaned), judge.malformed_dead_lettered(inj.injected, facts.recs.dead_keys),
                  judge.still_learns(accept, promoted)]
    # the judged generations a dead letter accounts for, with what it said (a late feedback:
    # how late), for a reader to tell a fault's cost from a stage's mistake
    unrewarded = [{"generation_id": g, "dead_letters": facts.recs.details[g]} for g in facts.judged
                  if not facts.recs.rewards.get(g) and facts.recs.details.get(g)]
    return invariants, {"counts": counts, "dead_lettered_judged": unrewarded[:judge.SHOWN],
                        "accept_rate": {str(k): v for k, v in accept.items()}, "last_promoted": promoted}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flywheel.kafka.patches import install_client_patches
    from flywheel.settings import load_settings
    from local.demo import ensure_model

    install_client_patches()
    if os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP"):
        raise SystemExit("chaos stalls the embedded broker: unset FLYWHEEL_KAFKA_BOOTSTRAP")
    replicas = args.replicas or (1 if args.stream_db == "local" else 2)
    if args.stream_db == "local" and replicas > 1:
        raise SystemExit("chaos: --stream-db local keeps each process's state of its own: --replicas 1")
    if args.stream_db == "postgresql" and not args.pg_url:
        raise SystemExit("chaos: --stream-db postgresql needs a server (--pg-url)")
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="flywheel-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or ensure_model(root / "model")
    db = create_database(args.pg_url) if args.pg_url else None
    try:
        stream_url = {"postgresql": db.stream_url if db else "", "sqlite": f"sqlite:///{root / 'stream-state'}",
                      "local": ""}[args.stream_db]
        loop = Loop(root, model_dir, db, stream_url, replicas)
        settings = load_settings(env=loop.env, config_file=loop.config)
        faults = plan(args.duration, args.seed)
        _say(f"{len(faults)} faults over {args.duration:.0f} s (seed {args.seed}); data in {root}; "
             f"{replicas} replica(s) each of ingest and reward, stream state {args.stream_db}; release store "
             f"{'PostgreSQL database ' + db.name if db else 'SQLite'}")
        inj = Injector(loop, settings, random.Random(args.seed + 1), faults)
        try:
            facts = exercise(loop, inj, faults, settings, args)
        finally:
            inj.finish()
            loop.stop()
        invariants, numbers = verdict(facts, settings, inj, faults)
    finally:
        if db:
            drop_database(db)
    return {"duration_s": args.duration, "seed": args.seed, "rate": args.rate, "data_dir": str(root),
            "release_store": "postgresql" if db else "sqlite", "stream_db": args.stream_db, "replicas": replicas,
            "traffic": [facts.started, facts.ended],
            "faults": [asdict(f) for f in faults], **numbers, "served": {str(k): v for k, v in facts.served.items()},
            "recovery": recovery(faults), "takeover": takeover(faults), "pg_drop": pg_drops(faults),
            "reaped_by_up": reaped_by_up(root / "up.log", faults),
            "invariants": [asdict(i) for i in invariants], "ok": all(i.held for i in invariants)}


def reaped_by_up(up_log: Path, faults: list[Fault]) -> list[dict[str, Any]]:
    """What ``flywheel up`` found still running in a dead role's process group and killed before
    restarting it (its ``!! <role> left N process(es) running (pids ...)`` lines), each pid named
    by the command the run saw it run before the kill."""
    import re

    cmds = {int(pid): cmd for f in faults for pid, cmd in f.outcome.get("processes", {}).items()}
    out = []
    for m in re.finditer(r"!! (\S+) left \d+ process\(es\) running \(pids ([\d ]+)\)", up_log.read_text()):
        out.append({"role": m[1], "processes": {int(p): cmds.get(int(p), "?") for p in m[2].split()}})
    return out


def recovery(faults: list[Fault]) -> dict[str, dict[str, Any]]:
    """Per role: kills, and seconds from each kill until the role's /readyz answered again."""
    out: dict[str, dict[str, Any]] = {}
    for f in faults:
        if f.kind.startswith("kill:") and f.done_at is not None:
            row = out.setdefault(f.kind.split(":", 1)[1], {"kills": 0, "recovered_s": [], "not_recovered": 0})
            row["kills"] += 1
            if (s := f.outcome.get("recovered_s")) is not None:
                row["recovered_s"].append(s)
            else:
                row["not_recovered"] += 1
    for row in out.values():
        s = row["recovered_s"]
        row.update(p50=statistics.median(s) if s else None, max=max(s) if s else None)
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``xs`` (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s), max(1, math.ceil(q * len(s)))) - 1]


def takeover(faults: list[Fault]) -> dict[str, dict[str, Any]]:
    """Per stream stage: seconds from a replica's kill until its live replicas owned every
    partition again, over the kills of a replica that held partitions."""
    out: dict[str, dict[str, Any]] = {}
    for f in faults:
        role = f.kind.split(":", 1)[1] if f.kind.startswith("kill:") else None
        if role in STREAM_ROLES and f.done_at is not None:
            row = out.setdefault(role, {"kills": 0, "held_none": 0, "takeover_s": [], "not_covered": 0})
            row["kills"] += 1
            if not f.outcome.get("shards"):
                row["held_none"] += 1
            elif (s := f.outcome.get("takeover_s")) is not None:
                row["takeover_s"].append(s)
            else:
                row["not_covered"] += 1
    for row in out.values():
        row.update(p50=percentile(row["takeover_s"], 0.5), p95=percentile(row["takeover_s"], 0.95))
    return out


def pg_drops(faults: list[Fault]) -> dict[str, Any]:
    """The database faults: connections ended by application, and the stream replicas that
    restarted after each (other than those a kill fault hit)."""
    drops = [f for f in faults if f.kind == "pg_drop" and f.done_at is not None]
    ended: dict[str, int] = {}
    restarted = []
    for f in drops:
        for app, n in f.outcome.get("by_application", {}).items():
            ended[app] = ended.get(app, 0) + n
        if "stream_restarted" in f.outcome:
            restarted.append(sorted(set(f.outcome["stream_restarted"]) - set(f.outcome["killed_meanwhile"])))
    return {"drops": len(drops), "connections_ended": ended, "stream_restarted_per_drop": restarted}


def print_table(res: dict[str, Any]) -> None:
    kinds: dict[str, list[int]] = {}
    for f in res["faults"]:
        n = kinds.setdefault(f["kind"], [0, 0])
        n[0 if f["done_at"] is not None else 1] += 1
    print(f"\nwhole-loop fault run: {res['duration_s']:.0f} s, seed {res['seed']}, {res['replicas']} replica(s) "
          f"each of ingest and reward, stream state {res['stream_db']}, release store {res['release_store']}")
    print(f"{'fault':<28}{'done':>6}{'skipped':>9}")
    for kind, (done, skipped) in sorted(kinds.items()):
        print(f"{kind:<28}{done:>6}{skipped:>9}")
    print(f"{'total':<28}{sum(d for d, _ in kinds.values()):>6}{sum(s for _, s in kinds.values()):>9}")
    print(f"\n{'role':<10}{'kills':>6}{'ready again p50':>17}{'max':>8}{'never':>7}")
    for role, r in sorted(res["recovery"].items()):
        p50 = "-" if r["p50"] is None else f"{r['p50']:.1f} s"
        mx = "-" if r["max"] is None else f"{r['max']:.1f} s"
        print(f"{role:<10}{r['kills']:>6}{p50:>17}{mx:>8}{r['not_recovered']:>7}")
    if res["takeover"]:
        print(f"\n{'takeover':<10}{'kills':>6}{'held none':>11}{'p50':>9}{'p95':>9}{'max':>9}{'never':>7}")
    for role, t in sorted(res["takeover"].items()):
        p50, p95 = ("-" if v is None else f"{v:.1f} s" for v in (t["p50"], t["p95"]))
        mx = f"{max(t['takeover_s']):.1f} s" if t["takeover_s"] else "-"
        print(f"{role:<10}{t['kills']:>6}{t['held_none']:>11}{p50:>9}{p95:>9}{mx:>9}{t['not_covered']:>7}")
    if (d := res["pg_drop"])["drops"]:
        print(f"\npg_drop x{d['drops']}: connections ended {d['connections_ended']}; stream replicas restarted "
              f"after each (kills aside): {d['stream_restarted_per_drop']}")
    for r in res["reaped_by_up"]:
        print(f"flywheel up killed what {r['role']} left running: {r['processes']}")
    c = res["counts"]
    print(f"\njudged {c['judged']}: rewarded {c['rewarded']}, dead-lettered {c['dead_lettered']} "
          f"{c['dead_letter_reasons']}, lost {c['lost']}, double-counted {c['double_counted']}")
    for d in res["dead_lettered_judged"][:3]:
        print(f"  {d['generation_id']}: {'; '.join(d['dead_letters'])[:200]}")
    print(f"\n{'version':<9}{'requests':>9}{'judged':>8}{'accept rate':>13}")
    for v, a in res["accept_rate"].items():
        rate = "-" if a["accept_rate"] is None else f"{a['accept_rate']:.3f}"
        mark = "  (last promoted)" if str(res["last_promoted"]) == v else ""
        print(f"v{v:<8}{a['requests']:>9}{a['judged']:>8}{rate:>13}{mark}")
    print()
    for i in res["invariants"]:
        print(f"{'HELD  ' if i['held'] else 'BROKEN'}  {i['name']}: {i['detail']}")
        for e in i["evidence"][:3] if not i["held"] else ():
            print(f"          {json.dumps(e)[:200]}")
    print(f"\n{'every invariant held' if res['ok'] else 'INVARIANTS BROKEN'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flywheel chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic with faults (default 600)")
    ap.add_argument("--seed", type=int, default=0, help="draws the faults' times and the users")
    ap.add_argument("--rate", type=float, default=8.0, help="simulated requests per second (default 8, the demo's)")
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--settle", type=float, default=180.0,
                    help="longest wait after the traffic for every judged generation to be accounted for, s")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="longest wait for serving to answer, s")
    ap.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                    help="a PostgreSQL server's maintenance database: the run makes a database of its own there "
                         "for the release store and the stream state, and drops it at the end ('' keeps every "
                         "store on SQLite)")
    ap.add_argument("--stream-db", choices=("postgresql", "sqlite", "local"), default="postgresql",
                    help="where ingest's and reward's replicas keep their state: the run's PostgreSQL database "
                         "(default), SQLite files they share, or each process's own store (one replica)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="processes each of ingest and reward (default 2; 1 with --stream-db local)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where the run's loop keeps its data (default: a temp dir)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the model to start from (default: the small built one)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    print_table(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str))
        _say(f"results in {args.out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
