"""The whole-loop fault run's short form (bench/chaos.py): ``flywheel up`` (two replicas each of
ingest and reward on a PostgreSQL database of the run's own) and simulated users for 5 minutes
with faults across every role, and every invariant held. The full run (10 minutes, at
least 50 faults) is a command in the README."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ROLES = ("serve", "ingest", "reward", "train", "release")


@pytest.mark.slow  # 5 minutes of traffic, plus the loop's start (a minute or two) and its settle
@pytest.mark.timeout(1800)
def test_the_loop_keeps_every_invariant_through_five_minutes_of_faults(tmp_path, tiny_model_dir):
    # none of this process's settings, nor the process-group variables an in-process trainer test
    # left here (tests/integration/test_demo.py says why)
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k not in dist_vars}
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, "bench/chaos.py", "--duration", "300", "--seed", "1",
                          "--data-dir", str(tmp_path / "loop"), "--model-dir", str(tiny_model_dir), "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700, check=False)
    said = run.stdout[-6000:] + run.stderr[-3000:]
    assert out.exists(), said
    res = json.loads(out.read_text())
    done = [f for f in res["faults"] if f["done_at"] is not None]
    assert len(done) >= 15, said
    kinds = {f["kind"] for f in done}
    assert {f"kill:{r}" for r in ROLES} | {"broker_stop", "store_unreadable"} <= kinds, said
    assert {k for k in kinds if k.startswith("malformed:")} == {
        "malformed:generations", "malformed:feedback", "malformed:episodes", "malformed:rewards",
        "malformed:checkpoints", "malformed:serving_status", "malformed:releases"}, said
    # ingest and reward ran as two replicas each on the run's PostgreSQL database, and the
    # database fault hit them too
    assert res["stream_db"] == "postgresql" and res["replicas"] == 2 and res["release_store"] == "postgresql", said
    assert "pg_drop" in kinds, said
    assert "flywheel-stream" in res["pg_drop"]["connections_ended"], said
    # a killed replica's partitions were taken over by the stage's live replicas
    takeovers = [s for t in res["takeover"].values() for s in t["takeover_s"]]
    assert takeovers and not any(t["not_covered"] for t in res["takeover"].values()), said
    # every killed role answered /readyz again
    assert set(res["recovery"]) == set(ROLES) and not any(r["not_recovered"] for r in res["recovery"].values()), said
    assert res["counts"]["judged"] > 0 and res["counts"]["lost"] == 0 and res["counts"]["double_counted"] == 0, said
    broken = [i for i in res["invariants"] if not i["held"]]
    assert not broken, json.dumps(broken, indent=1) + "\n" + said
    assert run.returncode == 0, said
