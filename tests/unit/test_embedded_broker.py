"""The embedded broker's stall helper never leaves a shared broker stopped."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from local.broker import EmbeddedBroker


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from Linux /proc")
def test_a_pause_that_times_out_resumes_the_process_it_stopped(monkeypatch):
    proc = subprocess.Popen(["sleep", "30"])
    broker = EmbeddedBroker()
    broker._proc = proc
    # a thread that never shows as stopped (one in uninterruptible sleep) is what times a pause out
    monkeypatch.setattr(broker, "_stopped", lambda: False)
    try:
        with pytest.raises(TimeoutError):
            broker.pause(timeout_s=0.2)
        deadline = time.monotonic() + 5
        while _state(proc.pid) in "Tt" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) not in "Tt"  # SIGCONT was sent: later users find it answering
    finally:
        broker._proc = None
        proc.kill()
        proc.wait()
