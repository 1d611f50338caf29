"""``flywheel bench``: every performance claim of the project, measured in one run, as one table.

    flywheel bench                     # every row at full size (about 30 minutes on 2 cores)
    flywheel bench --quick             # every row at smoke size: proves each runs, numbers are not judged
    flywheel bench --only delta,ingest --json results.json
    flywheel bench --demo-report data/demo/report/summary.json   # the loop rows from a finished demo

Each row is a measurement and the baseline it is compared with, taken side by side in the same
run (the same process where the script allows), with its goal and whether it was met. The rows
come from the scripts in bench/, each run as its own process with ``--json``; this module only
runs them, reads their JSON and judges the goals (a script that states its own goal writes it
there, and that is the one definition). Goals are targets: a row that misses its goal, or measured
nothing (a loop that never doubled), says NO and is not fatal (the exit status is 0 unless a
script failed).

The loop rows (time-to-double, feedback-to-checkpoint, checkpoint-to-canary) come from a
``flywheel demo`` run (``--demo-report`` reuses one; otherwise this runs it, ~6 minutes) against
``bench/bare_loop.py``, the same preference learned by a bare in-process loop. Both time the same
thing: until the accept rate reached twice a well-measured start and held there; the bare loop
also runs its rule with learning off, and a rule that "doubles" then is no measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass
class Row:
    name: str
    value: float | None
    baseline: float | None
    unit: str
    #: "<= x" or ">= x" on ``ratio`` when there is a baseline, else on ``value``; None: a figure
    #: printed for what it is, judged by nothing (met is None, shown as "-")
    goal: str | None
    note: str = ""
    #: judge the goal on ``value`` even with a baseline (the baseline is context, not the yardstick)
    goal_on_value: bool = False

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline:
            return None
        return self.value / self.baseline

    @property
    def met(self) -> bool | None:
        """Whether the goal was met; a row with nothing measured (a loop that never doubled, a
        script that gave no number) has not met it. None for a row with no goal."""
        if self.goal is None:
            return None
        x = self.ratio if self.baseline is not None and not self.goal_on_value else self.value
        if x is None:
            return False
        op, bound = self.goal.split()
        return x <= float(bound) if op == "<=" else x >= float(bound)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


@dataclass(frozen=True)
class Job:
    """One bench script: its arguments at full and at smoke size, and the rows read from its JSON."""

    key: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    rows: Callable[[dict[str, Any]], list[Row]]
    env: tuple[tuple[str, str], ...] = ()


def _delta_rows(d: dict[str, Any]) -> list[Row]:
    """A size row per learning rate against XOR+zstd, the script's baseline to beat (its goal,
    from its JSON); the apply time at the first learning rate."""
    rows = [Row(f"delta bytes vs XOR+zstd, lr {lr}", r["ours"], r["naive"], "bytes", d["goal"],
                f"bf16 version after one AdamW step, {d['params'] / 1e6:.1f}M parameters; "
                f"{r['full'] / r['ours']:.1f}x smaller than the full weights")
            for lr, r in d["lrs"].items()]
    lr, r = next(iter(d["lrs"].items()))
    # the owner's call (issue 44): a delta pays where fetching is expensive, so the apply time is
    # judged against fetching the whole version from the object store (the object_store job's
    # row); against a warm local read it is context only
    return rows + [Row("delta apply time vs full local load", r["t_inplace"], r["t_load"], "s", None,
                       f"apply a delta in place vs read + hash the full weights (warm page cache), lr {lr}; "
                       "judged against the object store's full fetch: 'delta fetch + apply vs full fetch from S3'")]


def _ingest_rows(d: dict[str, Any]) -> list[Row]:
    block = next(iter(d["clients"].values()))
    rate = {row["path"].split(" [")[0]: row["records_per_s"] for row in block}
    raw_in = next(v for k, v in rate.items() if k.startswith("raw consume (generations"))
    raw_ep = next(v for k, v in rate.items() if k.startswith("raw consume (episodes"))
    return [Row("ingest records/s vs raw consume", rate["ingest: join -> episodes"], raw_in, "records/s", ">= 0.5",
                f"{d['pairs']} generations + feedback, exactly once, join, archive"),
            Row("reward records/s vs raw consume", rate["reward: label -> rewards"], raw_ep, "records/s", ">= 0.5",
                "episodes in, rewards out, exactly once, guards, archive")]


def _serving_rows(d: dict[str, Any]) -> list[Row]:
    return [Row("API serving vs raw vLLM", d["api_tokens_per_s"], d["offline_tokens_per_s"], "tokens/s", d["goal"],
                "HTTP API with every generation recorded to Kafka, vs vllm.LLM.generate offline")]


def _engine_stats_rows(d: dict[str, Any]) -> list[Row]:
    return [Row("engine statistics on vs off", d["on_tokens_per_cpu_s"], d["off_tokens_per_cpu_s"], "tokens/CPU-s",
                d["goal"], "vLLM's TTFT, ITL, queue and KV-cache statistics exported per engine (serve.engine_stats)"),
            Row("engine statistics: our stat logger's CPU per token", d["logger_us_per_token"],
                d["off_cpu_us_per_token"], "us/token", d["logger_goal"],
                "timed inside serving/engine_stats.py's logger, against the engine's CPU per token with them off")]


def _swap_rows(d: dict[str, Any]) -> list[Row]:
    phases = {p["phase"]: p for p in d["phases"]}
    in_place, two = phases["swaps, in place"], phases["two versions"]
    loads = sorted(a["load"] for a in d["releases"])
    answering = sorted(a["answering"] for a in d["releases"])
    return [Row("weight swap: p95 latency while swapping in place", in_place["p95_s"], two["p95_s"], "s", "<= 1.5",
                "requests paused under a reload, against the same two versions with no swap"),
            Row("weight swap: engine reload (pause), median", loads[len(loads) // 2] if loads else None, None, "s",
                "<= 0.5", "pause(keep) + reload + resume of one engine, all engines of a release"),
            Row("release record to new version answering, p95", _p95(answering), None, "s", "<= 5",
                "fetch, rebuild, verify, load and the first answer")]


def _adapter_rows(d: dict[str, Any]) -> list[Row]:
    """bench/adapter_serving.py: adapter versions on one engine against two full-weight engines."""
    full, ad, gap = d["full"], d["adapters"], d["gap"]
    note = "stable + canary as LoRA adapters on one engine, against full weights on two"
    return [Row("adapters on one engine: resident memory", ad["rss_gib"], full["rss_gib"], "GiB", "<= 0.7", note),
            Row("adapters on one engine: throughput", ad["tokens_per_s"], full["tokens_per_s"], "tokens/s", ">= 1.0",
                note),
            Row("adapters on one engine: p95 latency during swaps", ad["p95_swaps_s"], full["p95_swaps_s"], "s",
                "<= 1.0", "both routes replaced every 1.5 s: adapter add/remove against in-place reloads"),
            Row("adapters on one engine: release to answering, p95", ad["answering_p95_s"], full["answering_p95_s"],
                "s", "<= 1.0", "release record to the new version answering a pinned request"),
            Row("first adapter live: p95 latency after against before", d["first_adapter"]["after"]["p95_s"],
                d["first_adapter"]["before"]["p95_s"], "s", "<= 1.5",
                "the base model for every user, then the first adapter a canary for half, under one load"),
            Row("first adapter live: throughput after against before", d["first_adapter"]["after"]["tokens_per_s"],
                d["first_adapter"]["before"]["tokens_per_s"], "tokens/s", ">= 0.67",
                "a LoRA batch costs every request in it: below the arrival rate, requests queue"),
            Row("trainer (PEFT) vs vLLM LoRA logprob gap, mean", gap["mean"], None, "nats",
                f"<= {d['gap_goal_nats']}", f"fp32, {gap['tokens']} sampled tokens; max {gap['max']:.1e}")]


def _p95(xs: list[float]) -> float | None:
    return xs[max(0, -(-95 * len(xs) // 100) - 1)] if xs else None


def _canary_rows(d: dict[str, Any]) -> list[Row]:
    """bench/canary_stats.py: a false-PASS row per scenario, judged against alpha (the rows it marks
    as no goal, a contrast such as an invalid judge, stay in its own output), and the power rows."""
    rows = [Row(r["name"], r["value"], r["baseline"], r["unit"], "<= 1.0", r["note"])
            for r in d["rows"] if "baseline" in r and r["goal"]]
    return rows + [Row(r["name"], r["value"], None, r["unit"], ">= 0.8", r["note"])
                   for r in d["rows"] if "baseline" not in r]


def _picked(*picks: tuple[str, str, str | None, bool]) -> Callable[[dict[str, Any]], list[Row]]:
    """Rows of a script's own JSON rows, by name: (its name, the row's name here, goal, goal on
    value). A goal of None is the script's own, from its row: the one definition, beside the
    measurement it judges."""
    def rows(d: dict[str, Any]) -> list[Row]:
        mine = {r["name"]: r for r in d["rows"]}
        return [Row(name, mine[src]["value"], mine[src].get("baseline"), mine[src].get("unit", ""),
                    goal or mine[src]["goal"], mine[src].get("note", ""), on_value)
                for src, name, goal, on_value in picks]
    return rows


JOBS: tuple[Job, ...] = (
    Job("delta", "delta_compression.py", ("--versions", "3", "--lrs", "1e-5,1e-6"),
        ("--versions", "1", "--lrs", "1e-5,1e-6"), _delta_rows),
    Job("ingest", "ingest_throughput.py", ("--clients", "confluent"),
        ("--clients", "confluent", "--pairs", "6000", "--repeat", "1"), _ingest_rows),
    Job("pipeline", "pipelined_trainer.py", (), ("--quick",),
        _picked(("pipelined vs synchronous trainer", "pipelined vs synchronous trainer", None, False))),
    Job("serving", "serving_throughput.py", (), ("--prompts", "32", "--rounds", "1"), _serving_rows),
    Job("engine_stats", "engine_stats.py", (), ("--prompts", "16", "--rounds", "1"), _engine_stats_rows),
    Job("swap", "weight_swap.py", (), ("--seconds", "3", "--versions", "3"), _swap_rows),
    Job("adapters", "adapter_serving.py", (), ("--seconds", "3", "--gap-prompts", "4"), _adapter_rows),
    Job("gap", "logprob_gap.py", (), ("--quick",), _picked(
        ("trainer vs vLLM fp32 logprob gap, mean", "trainer vs vLLM logprob gap per token", "<= 0.01", True),
        ("trainer vs vLLM dtype=auto logprob gap, mean", "... with serving's default dtype (auto)", "<= 0.01", True))),
    # the first row is the loop row's baseline; the second, the doubling rule's rate with learning off
    Job("bare", "bare_loop.py", ("--control-seeds", ",".join(map(str, range(100, 110)))),
        ("--quick", "--control-seeds", "100"), _picked(
            ("bare in-process loop time-to-double", "bare loop", "<= 60", False),
            ("bare loop doublings with learning off", "bare loop 'doubles' at lr 0 (share of runs)", "<= 0.05", False))),
    Job("canary", "canary_stats.py", (), ("--quick",), _canary_rows),
    # figures with no goal: a lift's power at the k-th canary, against the budget before issue 45
    Job("canary_budget", "canary_budget.py", (), ("--quick",), lambda d: [
        Row(r["name"], r["value"], r["baseline"], r["unit"], None, r["note"]) for r in d["rows"]]),
    # the built model; SmolLM2's figures: --model-dir on its imported directory (README's table)
    Job("object_store", "object_store.py", ("--repeat", "5"), ("--repeat", "1"), _picked(
        ("checkpoint publish: S3 vs local filesystem", "checkpoint publish: S3 vs local filesystem", None, False),
        ("checkpoint fetch + verify: S3 vs local filesystem", "checkpoint fetch + verify: S3 vs local filesystem",
         None, False),
        ("delta fetch + apply vs full fetch from S3", "delta fetch + apply vs full fetch from S3", None, False))),
)


def loop_rows(summary: dict[str, Any], bare_s: float | None) -> list[Row]:
    """The rows a ``flywheel demo`` report answers (local/report.py's summary)."""
    lat, acc = summary["latency"], summary["accept_rate"]
    return [
        Row("full loop time-to-double vs bare in-process loop", acc["held_2x_from_s"], bare_s, "s", "<= 180",
            (f"seconds of traffic until the accept rate of the versions that stayed live, over {acc['hold_s']:.0f} s, "
             f"reached twice the start ({acc['start']:.2f}) and held to the end; the goal is on the loop's seconds")
            if acc["start"] is not None else "no start rate", goal_on_value=True),
        Row("feedback to checkpoint, p50", lat["feedback_to_checkpoint_s"]["p50"], None, "s", "<= 60", ""),
        Row("feedback to checkpoint, p95", lat["feedback_to_checkpoint_s"]["p95"], None, "s", "<= 90", ""),
        Row("checkpoint to canary, p50", lat["checkpoint_to_canary_s"]["p50"], None, "s", "<= 15", ""),
        Row("checkpoint to canary, p95", lat["checkpoint_to_canary_s"]["p95"], None, "s", "<= 30",
            f"{lat['checkpoint_to_canary_s']['n']} versions canaried"),
    ]


def run_job(job: Job, quick: bool, out: Path, timeout_s: float) -> tuple[list[Row], str | None]:
    """Run one script; its rows, or the reason it gave none."""
    cmd = [sys.executable, str(BENCH / job.script), *(job.quick if quick else job.full), "--json", str(out)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **dict(job.env)}, check=False)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout_s:.0f} s"
    print(f"  {job.script}: {time.monotonic() - t0:.0f} s, exit {done.returncode}", flush=True)
    if done.returncode != 0 or not out.exists():
        return [], f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"
    return job.rows(json.loads(out.read_text())), None


def run_demo(quick: bool, data_dir: Path) -> dict[str, Any] | None:
    args = ["--duration", "45", "--seed", "1"] if quick else []
    env = {k: v for k, v in os.environ.items() if k != "FLYWHEEL_CONFIG"}
    env["FLYWHEEL_DATA_DIR"] = str(data_dir)
    if quick:
        env["FLYWHEEL_TRAINER_PUBLISH_EVERY_STEPS"] = "4"  # a version within seconds of traffic
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", "demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    print(f"  flywheel demo: {time.monotonic() - t0:.0f} s, exit {done.returncode}", flush=True)
    path = data_dir / "demo" / "report" / "summary.json"
    return json.loads(path.read_text()) if done.returncode == 0 and path.exists() else None


def print_table(rows: list[Row]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else (f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}")

    print(f"\n{'row':<52}{'measured':>12}{'baseline':>12}{'ratio':>8}  {'goal':<9}{'met':<5}unit")
    for r in rows:
        met = "-" if r.met is None else "yes" if r.met else "NO"  # a goal not reached, measured or not, is NO
        print(f"{r.name:<52}{f(r.value):>12}{f(r.baseline):>12}{f(r.ratio):>8}  {r.goal or '-':<9}{met:<5}{r.unit}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flywheel bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every row at smoke size (for CI): numbers are not judged")
    ap.add_argument("--only", default="", help=f"comma-separated jobs of {[j.key for j in JOBS] + ['loop']}")
    ap.add_argument("--json", type=Path, default=None, help="also write every row here")
    ap.add_argument("--demo-report", type=Path, default=None, help="summary.json of a finished flywheel demo")
    ap.add_argument("--timeout", type=float, default=1800, help="longest a single script may run, s")
    args = ap.parse_args(argv)
    only = {k for k in args.only.split(",") if k}
    rows: list[Row] = []
    failed: dict[str, str] = {}
    bare_s = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-") as tmp:
        for job in JOBS:
            if only and job.key not in only and not (job.key == "bare" and "loop" in only):
                continue
            got, why = run_job(job, args.quick, Path(tmp) / f"{job.key}.json", args.timeout)
            if why:
                failed[job.key] = why
            if job.key == "bare":  # its time-to-double is the loop row's baseline; its other rows are rows
                bare_s = got[0].value if got else None
                got = got[1:]
            rows += got
        if not only or "loop" in only:
            summary = (json.loads(args.demo_report.read_text()) if args.demo_report
                       else run_demo(args.quick, Path(tmp) / "demo-data"))
            if summary is None:
                failed["loop"] = "flywheel demo wrote no report"
            else:
                rows += loop_rows(summary, bare_s)
    print_table(rows)
    if args.quick:
        print("\n--quick: smoke sizes; the numbers prove each row runs and are not judged")
    for key, why in failed.items():
        print(f"\nFAILED {key}: {why}")
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "rows": [r.to_json() for r in rows],
                                         "failed": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
