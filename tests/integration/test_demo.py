"""`make demo` end to end: the scripted session, the pipeline, and a trained checkpoint, on real parts."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_runs_the_loop_and_stops(tmp_path):
    # nor the process-group variables an in-process trainer test left here: the demo's trainer
    # would try to listen on this process's rendezvous port
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k not in dist_vars}
    env.update(FLYWHEEL_DATA_DIR=str(tmp_path), FLYWHEEL_MODEL_DIR=str(tmp_path / "model"))
    out = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--users", "8", "--wait", "240"],
        env=env, capture_output=True, text=True, timeout=480, check=False,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[demo]")]
    text = "\n".join(lines)
    assert out.returncode == 0, text + out.stderr[-3000:]
    # the scripted session: 5 generations recorded, each with one logprob per token
    recorded = re.findall(r"completion_tokens=(\d+) logprobs=(\d+)", text)
    assert len(recorded) == 5 and all(a == b for a, b in recorded)
    assert text.count("-> 202") == 5 and "with a bad body -> 400" in text
    # the pipeline: every judged sample got exactly one reward, and the trainer published v1
    episodes, rewards = map(int, re.search(r"episodes: (\d+), rewards: (\d+)", text).groups())
    assert episodes == rewards == 5 + 8 * 4
    assert re.search(r"checkpoint v1 \(parent 0, step \d+, \d+ samples, delta\)", text), text
    assert "every process it started has stopped" in text
