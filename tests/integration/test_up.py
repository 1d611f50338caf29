"""``flywheel up``'s supervisor on real processes: restarts with backoff that say so, an ordered stop,
and a broker death announced loudly and recovered from on the same port. The whole stack under
``flywheel up`` is the slow test at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from local.up import Backoff, Child, Supervisor, status_path

pytestmark = pytest.mark.integration

#: A child that notes its SIGTERM (name, time) in a file, then exits.
POLITE = """
import signal, sys, time
name, path = sys.argv[1], sys.argv[2]
def bye(*_):
    with open(path, "a") as f:
        f.write(f"{name} {time.time()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
while True:
    time.sleep(0.05)
"""


def _child(tmp_path: Path, name: str, code: str, *args: str) -> Child:
    return Child(name, [sys.executable, "-c", code, *args], dict(os.environ), tmp_path / "logs" / f"{name}.log")


def _run(sup: Supervisor) -> threading.Thread:
    t = threading.Thread(target=sup.run, kwargs={"poll_s": 0.05}, daemon=True)
    t.start()
    return t


def _until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_crashed_stage_is_restarted_with_backoff_and_says_so(tmp_path):
    said: list[str] = []
    crash = _child(tmp_path, "crashy", "import sys, time; time.sleep(0.2); sys.exit(3)")
    steady = _child(tmp_path, "steady", POLITE, "steady", str(tmp_path / "stops"))
    sup = Supervisor([crash, steady], tmp_path / "status.json", backoff=Backoff(base=0.2, cap=0.4, stable_s=30),
                     say=said.append)
    t = _run(sup)
    try:
        _until(lambda: crash.restarts >= 3)
        first_pid = steady.proc.pid
        status = json.loads((tmp_path / "status.json").read_text())
        row = next(s for s in status["stages"] if s["name"] == "crashy")
        assert row["restarts"] >= 2 and row["last_exit"] == 3
    finally:
        sup.request_stop()
        t.join(30)
    exits = [s for s in said if s.startswith("!! crashy exited with 3")]
    assert len(exits) >= 3 and any("restarting in 0s" in s for s in exits)  # 0.2, 0.4, 0.4 s: capped
    assert [s for s in said if s.startswith("!! restarted crashy")][:2] == [
        "!! restarted crashy (restart 1)", "!! restarted crashy (restart 2)"]
    assert steady.proc.pid == first_pid and steady.restarts == 0  # the healthy stage was left alone
    assert "--- " in (tmp_path / "logs" / "crashy.log").read_text()  # one log per stage, appended
    assert json.loads((tmp_path / "status.json").read_text())["stopped"] is True


def test_stop_sends_sigterm_in_reverse_start_order_and_waits_for_each(tmp_path):
    stops = tmp_path / "stops"
    names = ["ingest", "reward", "serve"]
    children = [_child(tmp_path, n, POLITE, n, str(stops)) for n in names]
    sup = Supervisor(children, tmp_path / "status.json", say=lambda _: None)
    t = _run(sup)
    _until(lambda: all(c.alive() for c in children))
    time.sleep(0.3)  # the children's handlers are installed
    sup.request_stop()
    t.join(30)
    order = [line.split()[0] for line in stops.read_text().splitlines()]
    assert order == ["serve", "reward", "ingest"]
    assert not any(c.alive() for c in children)


#: A child that starts a grandchild in its process group which ignores SIGTERM, as vLLM's engine
#: processes do, writes its pid to a file, then waits.
PARENT_OF_STUBBORN = """
import subprocess, sys, time
path = sys.argv[1]
kid = subprocess.Popen([sys.executable, "-c",
                        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(path, "a") as f:
    f.write(f"{kid.pid}\\n")
while True:
    time.sleep(0.05)
"""


def _live(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in ("Z", "X")  # a zombie holds nothing but its exit status


def test_what_a_killed_stage_left_running_is_killed_before_it_restarts(tmp_path):
    said: list[str] = []
    kids = tmp_path / "kids"
    child = _child(tmp_path, "serve", PARENT_OF_STUBBORN, str(kids))
    sup = Supervisor([child], tmp_path / "status.json", backoff=Backoff(base=0.2, cap=0.2, stable_s=30),
                     say=said.append)
    t = _run(sup)
    try:
        _until(lambda: kids.exists() and len(kids.read_text().split()) == 1)
        first = int(kids.read_text().split()[0])
        assert _live(first)
        os.kill(child.proc.pid, signal.SIGKILL)  # its grandchild is orphaned, still running
        _until(lambda: child.restarts == 1)
        # reaped before the restart, read from the process table
        assert not _live(first)
        assert any(s.startswith("!! serve left 1 process(es) running") and str(first) in s for s in said)
        _until(lambda: len(kids.read_text().split()) == 2)
        second = int(kids.read_text().split()[1])
    finally:
        sup.request_stop()
        t.join(30)
    assert not _live(second)  # and a stop leaves nothing of the stage either (it ignored SIGTERM)


def test_a_dead_broker_is_announced_as_lost_data_and_replaced_on_its_port(tmp_path):
    from local.broker import EmbeddedBroker

    said: list[str] = []
    made_topics = []
    broker = EmbeddedBroker().start()
    child = _child(tmp_path, "ingest", POLITE, "ingest", str(tmp_path / "stops"))
    sup = Supervisor([child], tmp_path / "status.json", broker, topics=lambda: made_topics.append(1),
                     say=said.append)
    t = _run(sup)
    try:
        _until(child.alive)
        old_broker, old_child = broker.pid, child.proc.pid
        os.kill(old_broker, signal.SIGKILL)
        _until(lambda: sup.broker_restarts == 1 and child.alive() and child.proc.pid != old_child)
        assert broker.pid != old_broker and made_topics == [1]
        with socket.create_connection(("127.0.0.1", broker.port), timeout=5):
            pass  # the new broker answers on the same port
        loud = [s for s in said if "BROKER DIED" in s]
        assert len(loud) == 1 and "LOST" in loud[0]
        assert json.loads((tmp_path / "status.json").read_text())["broker"]["restarts"] == 1
    finally:
        sup.request_stop()
        t.join(30)
    assert broker.exited() is None or broker.pid is None  # stopped by the supervisor


def test_replicas_without_a_shared_state_database_are_refused_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_DATA_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-m", "cli", "up", "--replicas", "2"], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode != 0 and "needs stream.database_url" in run.stderr, run.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # no model built, no broker, no status


def test_replicas_of_the_stream_stages_are_named_and_get_ports_of_their_own():
    from flywheel.settings import load_settings
    from local.broker import free_port
    from local.up import plan_children

    settings = load_settings(env={"FLYWHEEL_STREAM_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/x"})
    env = {"FLYWHEEL_INGEST_PORT": "9301"}
    plan = plan_children(settings, env, 3, free_port)
    names = [name for name, _, _, _ in plan]
    assert names == ["ingest-1", "ingest-2", "ingest-3", "reward-1", "reward-2", "reward-3", "train", "release",
                     "serve"]
    ports = {name: port for name, _, _, port in plan}
    assert ports["ingest-1"] == 9301 and ports["reward-1"] == settings.reward.port  # the first keeps the stage's
    assert len(set(ports.values())) == len(plan)
    assert {var for name, _, var, _ in plan if name.startswith("reward")} == {"FLYWHEEL_REWARD_PORT"}
    assert [name for name, _, _, _ in plan_children(settings, env, 1, free_port)][:2] == ["ingest", "reward"]


@pytest.mark.slow
def test_flywheel_up_runs_every_stage_and_stops_them_all_on_sigterm(tmp_path, tiny_model_dir):
    from local.broker import free_port

    ports = {k: str(free_port()) for k in ("SERVE", "INGEST", "REWARD", "TRAINER", "RELEASE")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update({f"FLYWHEEL_{k}_PORT": v for k, v in ports.items()}, FLYWHEEL_DATA_DIR=str(tmp_path),
               FLYWHEEL_MODEL_DIR=str(tiny_model_dir), FLYWHEEL_SERVE_ENGINES="1", FLYWHEEL_API_KEYS="sk-up")
    up = subprocess.Popen([sys.executable, "-m", "cli", "up"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        _until(lambda: _healthy(f"http://127.0.0.1:{ports['SERVE']}/health"), timeout_s=300)
        _until(lambda: _healthy(f"http://127.0.0.1:{ports['RELEASE']}/health"), timeout_s=120)
        status = subprocess.run([sys.executable, "-m", "cli", "status"], env=env, capture_output=True, text=True,
                                check=False)
        assert status.returncode == 0 and "running" in status.stdout, status.stdout
        pids = [s["pid"] for s in json.loads(status_path(tmp_path).read_text())["stages"]]
        assert all(pids)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=180) == 0
    finally:
        if up.poll() is None:
            up.kill()
    out = up.stdout.read()
    assert "every process flywheel up started has stopped" in out, out[-3000:]
    for pid in pids:  # no stage outlived it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
