"""The whole-loop fault run: ``flywheel up`` and simulated users for minutes, with faults injected
across every role, then the invariants checked from what the run left.

    python bench/chaos.py --out chaos.json                  # 10 minutes, at least 50 faults
    python bench/chaos.py --duration 300 --out chaos.json   # the short form (the slow test's)
    flywheel chaos --duration 600 --seed 3 --out chaos.json

The loop runs with the demo's settings (``local/demo.toml``), its release store in a throwaway
PostgreSQL schema (``--pg-url``; ``--pg-url ''`` keeps SQLite and drops the database fault).
While the users are simulated (``flywheel simulate``'s population), faults land at random times
drawn from ``--seed``, each kind spread over the run (one at a random moment of each equal slice),
each logged with its time:

- ``kill:<role>``: SIGKILL of serving, ingest, reward, the trainer or the release controller, by
  the pid ``flywheel up``'s status names (a role's list of pids: several replicas are one more
  entry). ``up`` restarts it; the time until its ``/readyz`` answers 200 again is its recovery.
  Every process of the killed instance (serving's vLLM engines above all) is read from ``/proc``
  before the kill and must be gone within :data:`ORPHAN_WAIT_S`.
- ``broker_stop``: SIGSTOP of the embedded broker for 5-30 s, then SIGCONT.
- ``pg_drop``: every connection of the loop to PostgreSQL ended by ``pg_terminate_backend``, which
  is what a database restart or a failover looks like to a client. The server itself is shared
  with other users of the machine and is not restarted.
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

    def __init__(self, root: Path, model_dir: Path, pg_url: str | None) -> None:
        from local.broker import free_port
        from local.up import STAGES, status_path

        self.root, self.model_dir, self.pg_url = root, model_dir, pg_url
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
        if pg_url:
            self.env["FLYWHEEL_DATABASE_URL"] = pg_url
        self.proc: subprocess.Popen | None = None
        #: whether ``up`` runs without CAP_DAC_OVERRIDE, so a chmod binds it (always, as non-root)
        self.mode_binds = os.geteuid() != 0

    def start(self, timeout_s: float) -> None:
        from local.demo import _wait_healthy

        argv = [sys.executable, "-m", "cli", "up"]
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

    def pids(self, role: str) -> list[int]:
        """The live pids of ``role`` (one per replica; ``flywheel up`` runs one)."""
        return [s["pid"] for s in self.status()["stages"] if s["name"] == role and s["pid"]]

    def broker_pid(self) -> int:
        return self.status()["broker"]["pid"]

    def ready(self, role: str) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url(role)}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


# -- faults -----------------------------------------------------------------------------------------
class Injector:
    def __init__(self, loop: Loop, settings: Any, rng: random.Random) -> None:
        self.loop, self.settings, self.rng = loop, settings, rng
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
        while not (pids := self.loop.pids(role)):  # restarting still from an earlier fault
            if time.monotonic() > deadline:
                fault.outcome = {"skipped": f"{role} had no live process for 30 s"}
                return
            time.sleep(1)
        pid = self.rng.choice(pids)
        leader, family = proc_of(pid), descendants(pid)
        os.kill(pid, signal.SIGKILL)
        fault.done_at = time.time()
        fault.outcome = {"pid": pid, "processes": {p.pid: p.cmd[:80] for p in family},
                         "engines": [p.pid for p in family if "VLLM" in p.cmd]}
        self.seen.extend([leader, *family] if leader else family)
        self._later(self._watch, fault, role, pid, family)

    def _watch(self, fault: Fault, role: str, pid: int, family: list[Proc]) -> None:
        """How long the killed instance's processes lived on, and until the role was ready again."""
        t0 = fault.done_at
        left = list(family)
        while left and time.time() - t0 < ORPHAN_WAIT_S:
            left = [p for p in left if alive(p)]
            time.sleep(0.05)
        fault.outcome["left_running"] = [asdict(p) for p in left if alive(p)]
        fault.outcome["family_gone_s"] = None if left else round(time.time() - t0, 2)
        while time.time() - t0 < RECOVERY_WAIT_S:
            if (pids := self.loop.pids(role)) and pid not in pids and self.loop.ready(role):
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

        if not self.loop.pg_url:
            fault.outcome = {"skipped": "the release store is SQLite (--pg-url '')"}
            return
        app = _app_name(self.loop.pg_url)
        deadline = time.monotonic() + 30
        with psycopg.connect(_admin_url(self.loop.pg_url), autocommit=True, connect_timeout=5) as admin:
            # none while the controller restarts from an earlier kill: the fault waits for one
            while not (n := admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                          "WHERE application_name = %s", (app,)).fetchone()[0]):
                if time.monotonic() > deadline:
                    fault.outcome = {"skipped": "the loop held no connection to PostgreSQL for 30 s"}
                    return
                time.sleep(1)
        fault.done_at = time.time()
        fault.outcome = {"backends_terminated": n}

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


def _app_name(url: str) -> str:
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(url).query)["application_name"][0]


def _admin_url(url: str) -> str:
    return url.split("?", 1)[0]


def pg_schema(pg_url: str) -> tuple[str, str] | None:
    """A throwaway schema for the run's release store: (its URL, its name), None when no server."""
    import psycopg

    try:
        with psycopg.connect(pg_url, autocommit=True, connect_timeout=5) as admin:
            schema = f"chaos_{uuid.uuid4().hex[:12]}"
            admin.execute(f'CREATE SCHEMA "{schema}"')
    except psycopg.OperationalError as exc:
        _say(f"no PostgreSQL at {pg_url} ({exc}): the release store stays SQLite, no database faults")
        return None
    sep = "&" if "?" in pg_url else "?"
    return f"{pg_url}{sep}options=-csearch_path%3D{schema}&application_name={schema}", schema


def drop_schema(pg_url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (schema,))
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


# -- what the run left ------------------------------------------------------------------------------
def read_topic(kafka: Any, topic: str) -> list[Any]:
    from kafka import TopicPartition

    from flywheel.kafka.clients import read_to_end

    starts = {TopicPartition(topic, p): None for p in range(kafka.partitions)}
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
    for rec in read_topic(kafka, topics.rewards):
        try:
            gid = decode(RewardEvent, rec.value).generation_id
        except ValueError:
            continue  # a malformed one of ours: the trainer's dead letter accounts for it
        rewards.setdefault(gid, set()).add(rec.value)
    dead: dict[str, set[str]] = {}
    dead_keys, details = set(), {}
    for rec in read_topic(kafka, topics.deadletter):
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

    for rec in read_topic(kafka, topics.generations):
        try:
            g = decode(GenerationEvent, rec.value)
        except ValueError:
            continue
        note(g.model_version, g.created_at)
        for span in g.version_spans:
            note(span.version, g.created_at)
    for rec in read_topic(kafka, topics.serving_status):
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
    for rec in read_topic(kafka, topics.releases):
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
    for rec in read_topic(kafka, topics.checkpoints):
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
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="flywheel-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or ensure_model(root / "model")
    pg = pg_schema(args.pg_url) if args.pg_url else None
    try:
        loop = Loop(root, model_dir, pg[0] if pg else None)
        settings = load_settings(env=loop.env, config_file=loop.config)
        faults = plan(args.duration, args.seed)
        _say(f"{len(faults)} faults over {args.duration:.0f} s (seed {args.seed}); data in {root}; release store "
             f"{'PostgreSQL schema ' + pg[1] if pg else 'SQLite'}")
        inj = Injector(loop, settings, random.Random(args.seed + 1))
        try:
            facts = exercise(loop, inj, faults, settings, args)
        finally:
            inj.finish()
            loop.stop()
        invariants, numbers = verdict(facts, settings, inj, faults)
    finally:
        if pg:
            drop_schema(args.pg_url, pg[1])
    return {"duration_s": args.duration, "seed": args.seed, "rate": args.rate, "data_dir": str(root),
            "release_store": "postgresql" if pg else "sqlite", "traffic": [facts.started, facts.ended],
            "faults": [asdict(f) for f in faults], **numbers, "served": {str(k): v for k, v in facts.served.items()},
            "recovery": recovery(faults), "reaped_by_up": reaped_by_up(root / "up.log", faults),
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


def print_table(res: dict[str, Any]) -> None:
    kinds: dict[str, list[int]] = {}
    for f in res["faults"]:
        n = kinds.setdefault(f["kind"], [0, 0])
        n[0 if f["done_at"] is not None else 1] += 1
    print(f"\nwhole-loop fault run: {res['duration_s']:.0f} s, seed {res['seed']}, release store {res['release_store']}")
    print(f"{'fault':<28}{'done':>6}{'skipped':>9}")
    for kind, (done, skipped) in sorted(kinds.items()):
        print(f"{kind:<28}{done:>6}{skipped:>9}")
    print(f"{'total':<28}{sum(d for d, _ in kinds.values()):>6}{sum(s for _, s in kinds.values()):>9}")
    print(f"\n{'role':<10}{'kills':>6}{'ready again p50':>17}{'max':>8}{'never':>7}")
    for role, r in sorted(res["recovery"].items()):
        p50 = "-" if r["p50"] is None else f"{r['p50']:.1f} s"
        mx = "-" if r["max"] is None else f"{r['max']:.1f} s"
        print(f"{role:<10}{r['kills']:>6}{p50:>17}{mx:>8}{r['not_recovered']:>7}")
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
    ap.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test",
                    help="PostgreSQL for the release store, in a throwaway schema ('' keeps SQLite)")
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
