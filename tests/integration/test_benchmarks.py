"""The stage benchmarks still run end to end and print every row (their numbers are not judged
here: speed is measured by running them, never by timed assertions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(?P<label>\S.*?)\s+(?P<rate>[\d,]+)\s+(?P<ratio>\d+\.\d\d)\b")


def run_bench(script: str, *args: str) -> list[tuple[str, float, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    out = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=540, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [m for line in out.stdout.splitlines() if (m := ROW.match(line))]
    return [(m["label"], float(m["rate"].replace(",", "")), float(m["ratio"])) for m in rows]


@pytest.mark.slow  # 20-30 s of two stages at full speed: with the slow tests, to keep the default suite short
def test_ingest_throughput_prints_stage_raw_and_relay_rows():
    # more records than one poll returns (5000), so every row counts records after its first batch
    rows = run_bench("ingest_throughput.py", "--pairs", "6000", "--repeat", "1", "--clients", "confluent")
    assert [label for label, _, _ in rows] == [
        "raw consume (generations+feedback)", "ingest: join -> episodes [confluent]",
        "raw consume (episodes)", "reward: label -> rewards [confluent]",
        "relay: consume + send, no work [confluent]", "exactly-once relay, no decode [confluent]",
        "exactly-once relay + validate [confluent]", "raw consume (generations+feedback)",
        "floor, ingest's shape: validate, join, send, file", "floor, ingest's shape: same, SQLite instead",
        "raw consume (episodes)", "floor: consume + acked send",
        "floor: + outputs durable (file, fsync)", "floor: + parse each record (no validation)",
        "floor: + validate instead (the contract's decode)", "floor: same, durable in SQLite instead"]
    assert all(rate > 0 for _, rate, _ in rows)
    assert rows[0][2] == rows[2][2] == rows[7][2] == rows[10][2] == 1.0  # each raw row: the base of those after it


@pytest.mark.slow
def test_stage_scaleout_runs_the_deployed_stages():
    # enough records that no stage finishes between two of the bench's 50 ms samples
    rows = run_bench("stage_scaleout.py", "--pairs", "24000", "--processes", "1,2")
    assert [label for label, _, _ in rows if "process" in label] == [
        "ingest, 1 process(es)", "reward, 1 process(es)", "ingest, 2 process(es)", "reward, 2 process(es)"]
    assert all(rate > 0 for _, rate, _ in rows)


def test_decode_cost_prints_a_row_per_record_kind():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    out = subprocess.run([sys.executable, "bench/decode_cost.py", "--n", "200"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["GenerationEvent", "FeedbackEvent", "EpisodeEvent"]
    for _, size, parse, full, ratio in rows:
        assert int(size) > 0 and float(parse) > 0 and float(full) > 0
        assert float(ratio) == pytest.approx(float(full) / float(parse), abs=0.01)


@pytest.mark.slow  # 20-25 s of CPU, a bench's smoke run  # the default suite must stay under 14 minutes on 2 cores
def test_canary_stats_prints_every_table(tmp_path):
    rows = run_bench("canary_stats.py", "--quick", "--json", str(tmp_path / "canary.json"))
    import json

    # (c) and (d), through the controller's fold and judge: a row per scenario, and the contrasts
    written = json.loads((tmp_path / "canary.json").read_text())["rows"]
    adversary = [r for r in written if r["name"].startswith(("canary false PASS: ", "canary false rollback: "))
                 and "within" in r]
    fold = {r["name"].split(": ", 1)[1]: r for r in written if r not in adversary}
    # (e): two rows per adversary or condition, each judged against the level it was tested at
    names = [r["name"].split(": ", 1)[1] for r in adversary]
    assert names[::2] == names[1::2] and len(names) == 26, names
    assert {"rejects held, sent in bursts every 30 s, share 0.1", "30 sock puppets that see their arm",
            "one requester, answers accepted under 60 rater ids",
            "time of day: accept rate 0.15 -> 0.45 over the run, share 0.1"} <= set(names)
    assert all(r["within"] in ("OK", "noise", "over") and 0 < r["baseline"] <= 0.05 for r in adversary)
    assert list(fold) == ["i.i.d. users", "an abusive user (10% of requests), reward's guards fresh",
                          "late feedback (30% up to 300 s, rejects later)",
                          "two tastes (0.55 / 0.10), 60 heavy-tailed users", "the demo's settings: 210 s of canaries",
                          "the demo's settings, each canary at alpha (no budget)",
                          "i.i.d. users, a fixed-horizon z-test asked as often (invalid)",
                          "half the users on the canary, 2,000 users, 20 requests/s, 5 min",
                          "10% of users on the canary, 6,000 users, 40 requests/s, 10 min"]
    valid = [r for r in fold.values() if r.get("goal")]
    assert len(valid) == 5 and all(r["value"] <= r["baseline"] + 3 * r["se"] for r in valid), valid
    naive = fold["i.i.d. users, a fixed-horizon z-test asked as often (invalid)"]
    assert naive["value"] > fold["i.i.d. users"]["value"] + 0.1  # 20 runs: a wide margin, 0.25 seen
    rows = rows[-15:]  # (a) and (b), numpy alone
    shapes = [re.sub(r"\d[\d.,]*", "#", " ".join(label.split())) for label, _, _ in rows]
    lift = ["# vs # fixed-horizon z-test, power # (sim #)", "# vs # always-valid e-process, mean (cap if none)",
            "# vs # always-valid e-process, median", "# vs # always-valid e-process, #th percentile",
            "# vs # always-valid e-process, cap (PASS by it #)"]
    assert shapes == [*lift, *lift,
                      "always-valid e-process, every pair: false PASS",
                      "always-valid e-process, every pair: any verdict",
                      "z-test, every pair: false PASS", "z-test, every pair: any verdict",
                      "z-test, once at the last pair: false PASS"]
    assert rows[0][2] == rows[5][2] == 1.0  # each fixed-horizon row: the base of the rows after it
    assert rows[2][2] < 1 and rows[7][2] < 1  # the median canary needs fewer pairs than the fixed test
    # watched after every pair, the z-test raises false alarms at several times its nominal rate,
    # the e-process at most at about its nominal rate (seeded, 300 runs: the margins are wide)
    assert rows[12][2] > 3 and rows[10][2] < rows[12][2] / 3


@pytest.mark.slow
def test_weight_swap_prints_every_phase_and_the_release_phases(tmp_path):
    # two engines and four short load phases: a couple of minutes, so with the slow tests
    out = tmp_path / "swap.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    done = subprocess.run([sys.executable, "bench/weight_swap.py", "--seconds", "3", "--versions", "3",
                           "--swap-every", "1", "--concurrency", "4", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    assert [p["phase"] for p in result["phases"]] == ["one version", "two versions", "swaps, idle engine",
                                                     "swaps, in place"]
    assert all(p["requests"] > 0 and p["p95_s"] >= p["p50_s"] > 0 for p in result["phases"])
    assert result["releases"] and all(set(r) >= {"answering", "fetch", "rebuild", "verify", "load"}
                                      for r in result["releases"])
    assert result["rss_gib"][1] > result["rss_gib"][0] > 0


@pytest.mark.slow  # every bench script at smoke size, and a short demo: about 10 minutes on 2 cores
def test_flywheel_bench_quick_runs_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_MODEL_DIR"] = str(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "--quick", "--json", str(tmp_path / "bench.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import json

    got = json.loads((tmp_path / "bench.json").read_text())
    names = {r["name"] for r in got["rows"]}
    for expected in ("delta bytes vs XOR+zstd, lr 1e-5", "delta bytes vs XOR+zstd, lr 1e-6",
                     "bare loop 'doubles' at lr 0 (share of runs)", "ingest records/s vs raw consume",
                     "reward records/s vs raw consume",
                     "pipelined vs synchronous trainer", "API serving vs raw vLLM",
                     "full loop time-to-double vs bare in-process loop", "feedback to checkpoint, p95",
                     "checkpoint to canary, p95", "trainer vs vLLM logprob gap per token",
                     "weight swap: p95 latency while swapping in place", "engine statistics on vs off"):
        assert expected in names, names
    measured = {r["name"]: r["value"] for r in got["rows"]}
    # a 45 s demo need not double the accept rate; every other row is measured
    assert all(v is not None for k, v in measured.items() if not k.startswith("full loop")), measured
    assert "full loop time-to-double" in out.stdout and not got["failed"]
