"""No vLLM engine outlives the serving process that started it (serving/tether.py): a kill -9 of
``flywheel serve`` takes its engine processes (``VLLM::EngineCore`` and ``VLLM::Worker``) with it.

Read from the process table (``/proc``), not the ports: an orphaned engine holds no port, only its
memory. Slow: the process starts its own two vLLM engines (about 50 s), so it runs with
``make test-slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.processes import group_members
from local.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below ``root``, from /proc."""
    parent_of, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split(" ", 2)[:2]
        if state not in ("Z", "X"):
            parent_of[int(entry.name)], cmdline[int(entry.name)] = int(ppid), cmd
    out = {}
    for pid in parent_of:
        p = pid
        while p in parent_of and p != root:
            p = parent_of[p]
        if p == root and pid != root:
            out[pid] = cmdline[pid]
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] not in ("Z", "X")


def test_a_killed_serving_process_leaves_no_engine_running(broker, topics, tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(tiny_model_dir), "FLYWHEEL_DATA_DIR": str(tmp_path),
           "FLYWHEEL_API_KEYS": "sk-orphans", "FLYWHEEL_SERVE_USER_ID_SALT": "test-salt-of-sixteen-characters",
           "FLYWHEEL_ROUTING_SECRET": "test-routing-secret-of-sixteen",
           "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap,
           "FLYWHEEL_TOPIC_PREFIX": topics.prefix, "FLYWHEEL_SERVE_PORT": str(port),
           # no release controller here: ready at once on the model directory, not after the wait for one
           "FLYWHEEL_SERVE_ROUTING_WAIT_S": "0"}
    # its own session, as under flywheel up: the group is what is checked for leftovers below
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    engines: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 420  # two engines start, then warm up, on a shared 2-core machine
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not become ready"
            time.sleep(0.5)
        engines = {pid: cmd for pid, cmd in _descendants(proc.pid).items() if "VLLM::" in cmd}
        kinds = sorted(cmd.split("::")[1].split()[0] for cmd in engines.values())
        assert [k for k in kinds if k.startswith("EngineCore")] == ["EngineCore", "EngineCore"], kinds
        assert len([k for k in kinds if k.startswith("Worker")]) == 2, kinds
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the kernel signals the engines as serving dies, and each worker as its engine dies; the
        # wait is generous for a loaded machine, and the assertion is about the end state
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: cmd for pid, cmd in engines.items() if _alive(pid)}
        assert left == {}, f"engine processes outlived serving: {left}"
        assert group_members(proc.pid) == []  # nothing else of the instance either
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in engines:  # never leave them behind, whatever failed above
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
