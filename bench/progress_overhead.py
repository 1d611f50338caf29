"""What a progress bar costs `flywheel checkpoint verify`: a version rebuilt from its base and one
delta, without a bar and with a tqdm bar drawn (flywheel/progress.py), median of several runs.

    .venv/bin/python bench/progress_overhead.py [--mb 256] [--runs 5]

The store is a real one in a temporary directory: float32 weights of ``--mb`` MiB, three
versions, the middle one pruned to its delta, so ``materialize_bytes(1)`` reads and hashes the
base, applies the delta and hashes the result, reporting each block. The bar is drawn to
/dev/null as to a terminal (a terminal's own drawing is the terminal's time, not ours). Goal: the
bar within 5% of no bar. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flywheel.checkpoints.store import CheckpointStore
from flywheel.progress import SILENT, Progress, _Terminal


def build(root: Path, mib: int) -> CheckpointStore:
    src = root / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal(mib * (1 << 20) // 4, dtype=np.float32)}
    store = CheckpointStore(root / "store", full_every=10, keep_full=1)
    for version in range(3):
        tmp = store.staging_dir(version)
        if version:  # an RL step moves few values: a small delta
            weights["w"][rng.integers(0, weights["w"].size, 10_000)] += 1e-3
        save_file(weights, str(tmp / "model.safetensors"))
        store.commit(tmp, version=version, parent=version - 1 if version else None, source_dir=src,
                     extra={}, ledger={})
    return store


def timed(store: CheckpointStore, progress: Progress, runs: int) -> float:
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        store.materialize_bytes(1, progress)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="weights size in MiB (default 256)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, open("/dev/null", "w") as devnull:
        store = build(Path(tmp), args.mb)
        timed(store, SILENT, 1)  # page cache warm for both
        # alternated so a machine's load drifts over both alike
        silent, bar = [], []
        for _ in range(args.runs):
            silent.append(timed(store, SILENT, 1))
            bar.append(timed(store, _Terminal(devnull), 1))
    result = {"weights_mib": args.mb, "silent_s": statistics.median(silent), "bar_s": statistics.median(bar)}
    result["bar_over_silent"] = result["bar_s"] / result["silent_s"]
    result["goal_met"] = result["bar_over_silent"] <= 1.05
    print(json.dumps(result, sort_keys=True))
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
