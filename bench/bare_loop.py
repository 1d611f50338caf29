"""The fastest the tiny model can learn the simulated users' taste: a bare in-process loop.

    python bench/bare_loop.py [--lr 3e-3] [--batch 16] [--steps 80] [--seeds 0,1,2]
                              [--control-seeds 10,11,...] [--quick] [--json PATH]

No Kafka, no serving, no stages, no checkpoints: one process samples ``--batch`` completions of a
prompt from the locally built tiny model and has the simulated users judge them (local/taste.py's
Sampler: transformers, temperature 1, 24 tokens, as ``flywheel simulate`` asks serving for; each
answer by a random user of the default cohorts, noise and missing feedback included), and takes
one REINFORCE step (batch-mean baseline, AdamW) on the judged ones.

**Doubled** (:func:`doubled_at`) means what the demo's report means by it: held, against a start
measured well. The start is :data:`START_BATCHES` batches of the untrained model, no step taken;
the accept rate over the last :data:`SPAN` batches must reach twice it and stay there for
:data:`HOLD` more. The seconds count from the first training step to the batch where the held
stretch began. The first rule here (the mean of 4 batch rates while training, against twice the
first 4) "doubled" in 18-38% of runs with learning off: a low start or one lucky window was
enough. ``--control-seeds`` runs the same loop at lr 0 and reports how many runs still
"doubled": the rule's false-doubling rate, which should be about nothing.

This is the baseline of ``flywheel bench``'s "full loop time-to-double" row: whatever the
system adds (serving, topics, join, reward, publishing, canary statistics) is the gap between
this and the time a ``flywheel demo`` run's accept rate took to reach twice its start and hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flywheel.modelinit import init_model
from local.taste import Counts, Sampler, counts

#: Batches of the untrained model that measure the start: about 160 judgements, a standard error
#: near 0.035 at 0.25. A start measured low makes a doubling easy.
START_BATCHES = 12
#: Batches pooled into each accept rate compared with twice the start.
SPAN = 8
#: Further batches over which that rate must stay at twice the start: the window replaced whole.
HOLD = 8

def doubled_at(start: Counts, batches: list[Counts]) -> int | None:
    """Index of the training batch where the accept rate over the last :data:`SPAN` batches
    reached twice the start's and stayed there through :data:`HOLD` more batches (None: not
    within ``batches``). Rates pool the judgements, so a batch with few weighs little."""
    if not start[0] or not start[1]:
        return None  # twice nothing is no doubling
    twice = 2 * start[0] / start[1]
    since = None
    for i in range(SPAN - 1, len(batches)):
        accepts, judged = map(sum, zip(*batches[i - SPAN + 1:i + 1]))
        if judged and accepts / judged >= twice:
            since = i if since is None else since
            if i - since >= HOLD:
                return since
        else:
            since = None
    return None


class Loop:
    """The tiny model, sampled and judged as local/taste.py's Sampler does, and its optimizer."""

    def __init__(self, model_dir: Path, *, lr: float, batch: int, seed: int) -> None:
        import torch

        self.sampler = Sampler(model_dir, seed=seed)
        self.batch = batch
        self.opt = torch.optim.AdamW(self.sampler.model.parameters(), lr=lr, weight_decay=0.0)

    def sample(self) -> tuple[Any, int, list[str | None]]:
        return self.sampler.sample(self.batch)

    def step(self, out: Any, plen: int, signals: list[str | None]) -> Counts:
        """One REINFORCE step on the judged completions; the batch's (accepts, judgements)."""
        import torch

        judged = [i for i, s in enumerate(signals) if s is not None]
        if not judged:
            return 0, 0
        reward = torch.tensor([1.0 if signals[i] == "accept" else 0.0 for i in judged])
        model, pad = self.sampler.model, self.sampler.tok.pad_token_id
        model.train()
        sel = out[judged]
        mask = (sel[:, plen:] != pad).float()
        logits = model(sel).logits[:, plen - 1:-1]
        logp = torch.log_softmax(logits, -1).gather(-1, sel[:, plen:].unsqueeze(-1)).squeeze(-1)
        per_seq = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = -(per_seq * (reward - reward.mean())).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return int(reward.sum()), len(judged)


def time_to_double(model_dir: Path, *, lr: float, batch: int, steps: int, seed: int) -> dict[str, Any]:
    """Seconds and samples until the accept rate doubled and held (None: not within ``steps``),
    with every batch's counts."""
    loop = Loop(model_dir, lr=lr, batch=batch, seed=seed)
    start = [counts(loop.sample()[2]) for _ in range(START_BATCHES)]
    s = (sum(a for a, _ in start), sum(n for _, n in start))
    batches: list[Counts] = []
    at: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        batches.append(loop.step(*loop.sample()))
        at.append(time.perf_counter() - t0)
        since = doubled_at(s, batches)
        if since is not None:
            break
    window = batches[since - SPAN + 1:since + 1] if since is not None else batches[-SPAN:]
    return {"seconds": at[since] if since is not None else None,
            "samples": (since + 1) * batch if since is not None else None,
            "start": s[0] / s[1] if s[1] else None, "start_judged": s[1],
            "reached": sum(a for a, _ in window) / max(1, sum(n for _, n in window)), "batches": batches}


def median_seconds(runs: list[dict[str, Any]]) -> float | None:
    """Median seconds to double over every run, one that never doubled counting as forever (a
    median of the runs that doubled would hide those that did not); None when that is forever."""
    if not runs:
        return None
    mid = statistics.median(r["seconds"] if r["seconds"] is not None else float("inf") for r in runs)
    return mid if mid != float("inf") else None


def _print_runs(title: str, seeds: list[int], runs: list[dict[str, Any]]) -> None:
    print(title)
    print(f"{'seed':>4} {'start':>6} {'judged':>6} {'reached':>8} {'seconds':>8} {'samples':>8}")
    for s, r in zip(seeds, runs):
        fmt = (lambda x, d=2: "never" if x is None else f"{x:.{d}f}")
        print(f"{s:>4} {fmt(r['start']):>6} {r['start_judged']:>6} {fmt(r['reached']):>8} {fmt(r['seconds'], 1):>8} "
              f"{'never' if r['samples'] is None else r['samples']:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=80, help="training steps at most per run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--control-seeds", default="", help="seeds run at lr 0: how often the rule doubles without learning")
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads")
    ap.add_argument("--quick", action="store_true", help="one seed, a few steps: proves the rows run")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]
    controls = [int(s) for s in args.control_seeds.split(",") if s][:1 if args.quick else None]
    steps = SPAN + HOLD + 1 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / "model")
        runs = [time_to_double(model_dir, lr=args.lr, batch=args.batch, steps=steps, seed=s) for s in seeds]
        off = [time_to_double(model_dir, lr=0.0, batch=args.batch, steps=steps, seed=s) for s in controls]
    _print_runs(f"bare loop: tiny model, REINFORCE lr {args.lr:g}, batch {args.batch}, {args.threads} thread(s)", seeds, runs)
    value = median_seconds(runs)
    note = (f"median over seeds {seeds} of the seconds until the accept rate doubled and held, a run that never did "
            f"counting as forever ({sum(r['seconds'] is not None for r in runs)} of {len(runs)} did within {steps} steps)")
    print(note)
    rows = [{"name": "bare in-process loop time-to-double", "value": value, "unit": "s", "baseline": None,
             "ratio": None, "note": note, "runs": runs}]
    if off:
        _print_runs("the same at lr 0 (learning off)", controls, off)
        false = sum(r["seconds"] is not None for r in off)
        note = f"{false} of {len(off)} runs at lr 0 (seeds {controls}) 'doubled' within {steps} steps"
        print(note)
        rows.append({"name": "bare loop doublings with learning off", "value": false / len(off), "unit": "share",
                     "baseline": None, "ratio": None, "note": note, "runs": off})
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
