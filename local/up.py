"""``flywheel up``: the whole loop on one machine, every stage a supervised process.

    flywheel up                     # broker, serve, ingest, reward, train, release: Ctrl-C stops all
    flywheel status                 # what runs, its pid, port and restarts (from another terminal)

It starts the embedded Kafka-protocol broker, creates the topics, then runs ``flywheel serve``,
``ingest``, ``reward``, ``train`` and ``release serve`` as child processes, exactly the commands
production runs on their own (against an external Kafka and database instead). Each child logs to
``<data_dir>/logs/<stage>.log``. A child that exits is started again after a backoff (1 s doubling
to 60 s; reset once it has run for a minute), and the restart is printed. Each child runs in its
own process group: whatever of it is still running once it exited (read from ``/proc``) is killed
with SIGKILL, and said, before it is started again or when ``up`` stops, so a restart never runs
beside what the dead one left (a killed serving's vLLM engines die with it anyway:
serving/tether.py). Ctrl-C or SIGTERM stops
the children in order (serving first, so no request arrives at a pipeline being stopped, the
broker last), each with SIGTERM and up to 30 s to finish, and only then exits.

**The embedded broker keeps every topic in memory.** If it dies, every record in flight is gone:
unread generations and feedback, episodes, rewards, checkpoint announcements and routings (the
weights in the checkpoint store, serving's journal and the stages' local state survive). ``up``
says so loudly, starts a fresh broker on the same port and restarts every stage on it; use a real
Kafka cluster (``FLYWHEEL_KAFKA_BOOTSTRAP``) wherever that loss matters.

``flywheel up --replicas N`` runs N processes each of ingest and reward (``ingest-1`` ..
``ingest-N``, ``reward-1`` .. ``reward-N``), all in their stage's consumer group, sharing the
partitions, ``archive.root`` and their state in ``stream.database_url`` (docs/shared-state.md);
the first of each keeps the stage's port, the others get free ones (``flywheel status`` lists
them). It needs ``stream.database_url``: replicas on local stores would each keep a state of
their own.

The children get this process's environment (so ``FLYWHEEL_*`` settings and a config file apply
to all of them) plus what ``up`` sets: the broker address, the data and model directories, an API
key and a release-console token when none is configured (printed once at start), and signing
keys: where neither side of a signed record is configured, a key pair made at the first start
under ``<data_dir>/keys`` (kept for later runs), so the trainer signs its checkpoint
announcements and the controller its routings, and each reader trusts only the other's key
(docs/signing.md); and, while ``serve.user_id_salt`` is the published default (which serving
refuses beside API keys), a random salt kept in ``<data_dir>/up/user-id-salt``; while
``routing_secret`` is unset, a random one kept in ``<data_dir>/up/routing-secret``.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.processes import kill_group

#: The stages ``up`` runs, in start order (stopped in reverse, then the broker), and the setting
#: that holds each one's port.
STAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("ingest", ("ingest",), "FLYWHEEL_INGEST_PORT"),
    ("reward", ("reward",), "FLYWHEEL_REWARD_PORT"),
    ("train", ("train",), "FLYWHEEL_TRAINER_PORT"),
    ("release", ("release", "serve"), "FLYWHEEL_RELEASE_PORT"),
    ("serve", ("serve",), "FLYWHEEL_SERVE_PORT"),
)


@dataclass
class Backoff:
    """Seconds to wait before restart ``n`` (1-based): ``base * 2**(n-1)``, at most ``cap``."""

    base: float = 1.0
    cap: float = 60.0
    #: A child that ran this long before it exited starts its count again.
    stable_s: float = 60.0

    def delay(self, n: int) -> float:
        return min(self.cap, self.base * 2 ** max(0, n - 1))


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    port: int | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    #: Failures in a row (reset by a stable run): what the backoff counts.
    failures: int = 0
    due_at: float | None = None
    last_exit: int | None = None
    _log: Any = field(default=None, repr=False)

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} flywheel up starts {self.name} ---\n".encode())
        self._log.flush()
        # its own session: a terminal's Ctrl-C reaches only the supervisor, which stops the
        # children in order; and each child dies with the supervisor if that is killed outright
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 - the supervisor has no other threads
        self.started_at = time.monotonic()
        self.due_at = None

    def reap(self) -> list[int]:
        """Kill what the exited child left running in its process group (its own session: see
        :meth:`spawn`) and wait until the process table shows none; the pids killed.

        Serving's engines die with serving by themselves (serving/tether.py); this holds for any
        child and any version of it, before its replacement starts beside what is left."""
        if self.proc is None:
            return []
        left = kill_group(self.proc.pid)
        if left and self._log is not None:
            self._log.write(f"--- flywheel up killed what {self.name} left running: pids "
                            f"{' '.join(map(str, left))} ---\n".encode())
            self._log.flush()
        return left

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reap()
        if self._log is not None:
            self._log.close()
            self._log = None

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.proc.pid if self.alive() else None, "port": self.port,
                "state": "running" if self.alive() else ("restarting" if self.due_at else "stopped"),
                "restarts": self.restarts, "last_exit": self.last_exit, "log": str(self.log_path)}


class Supervisor:
    """Keeps ``children`` running (see the module docstring); ``broker`` is an EmbeddedBroker or None
    for an external Kafka."""

    def __init__(self, children: list[Child], status_path: Path, broker: Any = None, *,
                 backoff: Backoff | None = None, topics: Any = None, say: Any = print) -> None:
        self.children, self.status_path, self.broker = children, status_path, broker
        self.backoff, self.topics, self.say = backoff or Backoff(), topics, say
        self.broker_restarts = 0
        self._stop = threading.Event()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self, poll_s: float = 0.5) -> int:
        for child in self.children:
            child.spawn()
        self._status_line()
        try:
            while not self._stop.wait(poll_s):
                self.tick()
        finally:
            self.shutdown()
        return 0

    def tick(self) -> None:
        now = time.monotonic()
        if self.broker is not None and self.broker.exited() is not None:
            self._broker_died()
            return
        changed = False
        for child in self.children:
            if child.proc is not None and not child.alive() and child.due_at is None:
                child.last_exit = child.proc.returncode
                if left := child.reap():
                    self.say(f"!! {child.name} left {len(left)} process(es) running (pids {' '.join(map(str, left))}): "
                             "killed before it restarts")
                ran = now - child.started_at
                child.failures = 1 if ran >= self.backoff.stable_s else child.failures + 1
                child.due_at = now + self.backoff.delay(child.failures)
                self.say(f"!! {child.name} exited with {child.last_exit} after {ran:.0f}s; restarting in "
                         f"{child.due_at - now:.0f}s (log: {child.log_path})")
                changed = True
            elif child.due_at is not None and now >= child.due_at:
                child.restarts += 1
                child.spawn()
                self.say(f"!! restarted {child.name} (restart {child.restarts})")
                changed = True
        if changed:
            self._status_line()
        self._write_status()

    def _broker_died(self) -> None:
        code = self.broker.exited()
        self.say(f"!! THE EMBEDDED BROKER DIED (exit {code}): every topic and record it held in memory is LOST "
                 "(generations and feedback not yet joined, episodes, rewards, checkpoint announcements, "
                 "routings). Starting a fresh broker and restarting every stage on it.")
        for child in reversed(self.children):
            child.stop()
        self.broker.stop()
        self.broker.start()
        self.broker_restarts += 1
        if self.topics is not None:
            self.topics()
        for child in self.children:
            child.restarts += 1
            child.spawn()
        self._status_line()

    def shutdown(self) -> None:
        self.say("stopping: " + ", ".join(c.name for c in reversed(self.children)) +
                 (", then the broker" if self.broker is not None else ""))
        for child in reversed(self.children):
            child.due_at = None
            child.stop()
        if self.broker is not None:
            self.broker.stop()
        self._write_status(stopped=True)
        self.say("every process flywheel up started has stopped")

    def _status_line(self) -> None:
        parts = [f"broker {self.broker.bootstrap}"] if self.broker is not None else []
        for c in self.children:
            s = c.state()
            where = f":{c.port}" if c.port else ""
            parts.append(f"{c.name}{where} {s['state']}" + (f" ({c.restarts} restarts)" if c.restarts else ""))
        self.say("flywheel up: " + " · ".join(parts))
        self._write_status()

    def _write_status(self, stopped: bool = False) -> None:
        status = {"pid": os.getpid(), "stopped": stopped, "updated_at": time.time(),
                  "broker": None if self.broker is None else {"bootstrap": self.broker.bootstrap,
                                                              "pid": self.broker.pid,
                                                              "restarts": self.broker_restarts},
                  "stages": [c.state() for c in self.children]}
        tmp = self.status_path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(status, indent=2))
        os.replace(tmp, self.status_path)


def status_path(data_dir: Path) -> Path:
    return Path(data_dir) / "up" / "status.json"


def run(settings: Any, args: Any) -> int:
    """``flywheel up``."""
    from flywheel.contracts import Topics
    from flywheel.extras import require_vllm
    from flywheel.kafka.topics import ensure_declared
    from local.broker import EmbeddedBroker, free_port, tansu_binary
    from local.demo import ensure_model

    data_dir = Path(settings.data_dir)
    replicas = getattr(args, "replicas", None) or 1
    check_replicas(settings, replicas)  # before a model is built or a broker started
    bootstrap = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    if bootstrap is None:
        tansu_binary()  # an install without the embedded broker says so now, not after building a model
    require_vllm()  # and one without serving's engine (its child would exit 2 on every restart)
    model_dir = ensure_model(Path(settings.model_dir))
    broker = None
    if bootstrap is None:
        broker = EmbeddedBroker(port=getattr(args, "broker_port", None) or free_port()).start()
        bootstrap = broker.bootstrap
        print(f"embedded broker on {bootstrap}: topics live in its memory only (see `flywheel up --help`)", flush=True)
    kafka = settings.kafka.model_copy(update={"bootstrap": bootstrap})

    def topics() -> None:
        ensure_declared(kafka, Topics(settings.topic_prefix))

    topics()
    env = dict(os.environ, FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap, FLYWHEEL_DATA_DIR=str(data_dir),
               FLYWHEEL_MODEL_DIR=str(model_dir))
    # the global flags reach the children as the settings they stand for
    if getattr(args, "config", None):
        env["FLYWHEEL_CONFIG"] = str(Path(args.config).resolve())
    if getattr(args, "log_level", None):
        env["FLYWHEEL_LOG_LEVEL"] = args.log_level
    if getattr(args, "log_format", None):
        env["FLYWHEEL_LOG_FORMAT"] = args.log_format
    if not settings.serve.api_keys and not settings.serve.allow_anonymous:
        env["FLYWHEEL_API_KEYS"] = key = "sk-local-" + secrets.token_hex(8)
        print(f"API key for this run: {key}", flush=True)
    salt = local_salt(settings, data_dir / "up")
    if salt:
        env.pop("FLYWHEEL_SERVE_USER_ID_SALT", None)  # the published default said explicitly: replaced, not doubled
        env.update(salt)
    # serving's alone: no other stage reads it (serving/arms.py)
    routing = local_routing_secret(settings, data_dir / "up")
    if routing:
        env.pop("FLYWHEEL_ROUTING_SECRET", None)  # an empty one said explicitly: replaced, not doubled
    signing = local_keys(settings, data_dir / "keys")
    if signing:
        env.update(signing)
        print(f"checkpoints and releases are signed with the key pairs in {data_dir / 'keys'} (docs/signing.md)",
              flush=True)
    if not settings.release.tokens:
        token = secrets.token_hex(12)
        env["FLYWHEEL_RELEASE_TOKENS"] = f"local:admin:{token}"
        print(f"release console token (admin) for this run: {token}", flush=True)
    children = [Child(name, [sys.executable, "-m", "cli", *role],
                      {**env, **(routing if role[0] == "serve" else {}), port_var: str(port)},
                      data_dir / "logs" / f"{name}.log", port)
                for name, role, port_var, port in plan_children(settings, env, replicas, free_port)]
    sup = Supervisor(children, status_path(data_dir), broker, topics=topics)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, sup.request_stop)
    return sup.run()


#: The stages ``up --replicas N`` runs N processes of: the stream stages, whose replicas share
#: their partitions through the consumer group and their state through ``stream.database_url``.
REPLICATED = ("ingest", "reward")


def check_replicas(settings: Any, replicas: int) -> None:
    """Refuse ``--replicas`` above 1 without a shared state database (SystemExit, saying why)."""
    if replicas < 1:
        raise SystemExit(f"flywheel up: --replicas must be at least 1, not {replicas}")
    if replicas > 1 and not settings.stream.database_url:
        raise SystemExit(
            f"flywheel up --replicas {replicas} needs stream.database_url (FLYWHEEL_STREAM_DATABASE_URL): "
            "replicas on local stores would each keep a state of their own, and a partition's "
            "join windows and dedupe ids would not move with it (docs/shared-state.md)")


def plan_children(settings: Any, env: dict[str, str], replicas: int,
                  free_port: Any) -> list[tuple[str, tuple[str, ...], str, int]]:
    """(name, command, port setting, port) of each child, in start order: ``replicas`` of each
    stage in :data:`REPLICATED` (named ``<stage>-<n>`` when more than one; the first keeps the
    stage's port, the others get ``free_port()``), one of every other stage."""
    out = []
    for name, role, port_var in STAGES:
        port = int(env.get(port_var) or _default_port(settings, name))
        n = replicas if name in REPLICATED else 1
        for i in range(1, n + 1):
            out.append((f"{name}-{i}" if n > 1 else name, role, port_var, port if i == 1 else free_port()))
    return out


#: The records ``up`` signs, where neither side is configured: (key id, the writer's setting, the
#: reader's), as environment variables.
LOCAL_KEYS = (
    ("release-local", "FLYWHEEL_RELEASE_SIGNING_KEY", "FLYWHEEL_SERVE_TRUSTED_RELEASE_KEYS"),
    ("trainer-local", "FLYWHEEL_TRAINER_SIGNING_KEY", "FLYWHEEL_RELEASE_TRUSTED_CHECKPOINT_KEYS"),
)


def local_keys(settings: Any, keys_dir: Path) -> dict[str, str]:
    """Environment that signs the loop's releases and checkpoints with pairs kept in ``keys_dir``
    (made on first use), for each record neither of whose settings is set: one set means the
    operator configures that record, and the other stays theirs to set."""
    from flywheel.signing import generate_key_pair

    configured = {"FLYWHEEL_RELEASE_SIGNING_KEY": settings.release.signing_key,
                  "FLYWHEEL_SERVE_TRUSTED_RELEASE_KEYS": settings.serve.trusted_release_keys,
                  "FLYWHEEL_TRAINER_SIGNING_KEY": settings.trainer.signing_key,
                  "FLYWHEEL_RELEASE_TRUSTED_CHECKPOINT_KEYS": settings.release.trusted_checkpoint_keys}
    env: dict[str, str] = {}
    for key_id, signer, reader in LOCAL_KEYS:
        if configured[signer] or configured[reader]:
            continue
        private, public = keys_dir / f"{key_id}.key", keys_dir / f"{key_id}.pub"
        if not (private.exists() and public.exists()):
            generate_key_pair(keys_dir, key_id)  # refuses to overwrite a half pair: the message says which
        env[signer], env[reader] = str(private), str(public)
    return env


def local_salt(settings: Any, where: Path) -> dict[str, str]:
    """Environment that gives serving a random ``serve.user_id_salt`` kept in ``where/user-id-salt``
    (made on first use, mode 0600), while the settings hold the published default, which serving
    refuses with API keys (serving/main.py ``salt_refusal``). A file kept in the data directory,
    not a salt made per run and not a flag that tells serving "you are under up": the key ids and
    pseudonyms of this data directory's archive stay the same across restarts of ``up``, as a
    deployment's would, and serving applies one rule everywhere. The demo runs ``up`` in a fresh
    data directory, so each demo gets a salt of its own. An operator's own salt is left alone."""
    if not settings.serve.uses_default_salt:
        return {}
    # the file, not the value: a child's environment is readable in /proc by the same user
    return {"FLYWHEEL_SERVE_USER_ID_SALT_FILE": str(_secret_file(where, "user-id-salt"))}


def local_routing_secret(settings: Any, where: Path) -> dict[str, str]:
    """Environment that gives serving a random ``routing_secret`` kept in
    ``where/routing-secret`` while the settings hold none (serving refuses to split users without
    one beside API keys: serving/main.py ``routing_secret_refusal``); an operator's is left alone.
    Kept, as the salt is, so a restart of ``up`` mid-canary keeps the canary's split."""
    if settings.routing_secret:
        return {}
    return {"FLYWHEEL_ROUTING_SECRET_FILE": str(_secret_file(where, "routing-secret"))}


def _secret_file(where: Path, name: str) -> Path:
    """``where/name`` holding 64 random hex digits, made on first use (mode 0600) and kept: the
    local salt above, and the routing secret serving splits users by (``routing_secret``,
    serving/arms.py), which the processes ``up`` starts all read."""
    path = where / name
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def _default_port(settings: Any, name: str) -> int:
    return {"ingest": settings.ingest.port, "reward": settings.reward.port, "train": settings.trainer.port,
            "release": settings.release.port, "serve": settings.serve.port}[name]


def print_status(data_dir: Path, output: str = "table") -> int:
    """``flywheel status``: what ``flywheel up`` runs, read from its status file. ``-o json``
    (flywheel/output.py): the file's object (``pid``, ``stopped``, ``updated_at``, ``broker``,
    ``stages``: :meth:`Child.state`) with ``running`` (the supervisor's pid is alive) and
    ``age_s``; no file: ``{"running": false, "status_file": PATH}``. Exit 0 while it runs."""
    from flywheel.output import as_json

    path = status_path(data_dir)
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        print(as_json({"running": False, "status_file": str(path)}) if output == "json"
              else f"flywheel up is not running here (no {path})")
        return 1
    up = not status["stopped"] and _pid_alive(status["pid"])
    age = time.time() - status["updated_at"]
    if output == "json":
        if not up:  # the file keeps the pids of its last write: none of them runs now
            status["stages"] = [s | {"state": "stopped"} for s in status["stages"]]
        print(as_json(status | {"running": up, "age_s": age, "status_file": str(path)}))
        return 0 if up else 1
    print(f"flywheel up (pid {status['pid']}): {'running' if up else 'not running'}; status {age:.0f}s old")
    if status["broker"]:
        b = status["broker"]
        print(f"  broker   {b['bootstrap']:<22} pid {b['pid']}  restarts {b['restarts']} (in memory)")
    for s in status["stages"]:
        state = s["state"] if up else "stopped"
        print(f"  {s['name']:<9}:{s['port'] or '-':<21} {state:<10} pid {s['pid'] or '-'}  restarts {s['restarts']}"
              f"  log {s['log']}")
    return 0 if up else 1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
