"""The fastest the tiny model can learn the simulated users' taste: a bare in-process loop.

    python bench/bare_loop.py [--lr 3e-3] [--batch 16] [--steps 60] [--seeds 0,1,2] [--quick] [--json PATH]

No Kafka, no serving, no stages, no checkpoints: one process samples ``--batch`` completions of a
held-out prompt from the locally built tiny model (transformers, temperature 1, 24 tokens, as
``flywheel simulate`` asks serving for), judges each with the simulated population's hidden
preferences (local/simulate.py: each answer by a random user of the default cohorts, noise
and missing feedback included), and takes one REINFORCE step (batch-mean baseline, AdamW) on
the judged ones. It stops when the accept rate over the last 4 batches is at least twice the
first 4 batches' rate.

This is the baseline of ``flywheel bench``'s "full loop time-to-double" row: whatever the
system adds (serving, topics, join, reward, publishing, canary statistics) is the gap between
this and the doubling time a ``flywheel demo`` run measures on the same preference.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flywheel.modelinit import init_model
from local.simulate import DEFAULT_COHORTS, default_prompts, judge, population

#: Batches averaged for the start rate and for each later point.
SPAN = 4


def time_to_double(model_dir: Path, *, lr: float, batch: int, steps: int, seed: int) -> dict[str, float | None]:
    """Seconds and samples until the accept rate doubles (None: not within ``steps``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    users = population(40, DEFAULT_COHORTS, seed, gameable=False, abuser=False)
    prompts = default_prompts()
    rates: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        ids = tok.apply_chat_template([{"role": "user", "content": rng.choice(prompts)}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24,
                                 num_return_sequences=batch, pad_token_id=tok.pad_token_id)
        comp = out[:, ids.shape[1]:]
        texts = [tok.decode(c, skip_special_tokens=True) for c in comp]
        signals = [judge(rng.choice(users), t, rng) for t in texts]
        judged = [i for i, s in enumerate(signals) if s is not None]
        if not judged:
            continue
        reward = torch.tensor([1.0 if signals[i] == "accept" else 0.0 for i in judged])
        rates.append(float(reward.mean()))
        if len(rates) >= 2 * SPAN:
            start, now = statistics.mean(rates[:SPAN]), statistics.mean(rates[-SPAN:])
            if start > 0 and now >= 2 * start:
                return {"seconds": time.perf_counter() - t0, "samples": (step + 1) * batch, "start": start,
                        "reached": now}
        model.train()
        sel = out[judged]
        mask = (sel[:, ids.shape[1]:] != tok.pad_token_id).float()
        logits = model(sel).logits[:, ids.shape[1] - 1:-1]
        logp = torch.log_softmax(logits, -1).gather(-1, sel[:, ids.shape[1]:].unsqueeze(-1)).squeeze(-1)
        per_seq = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = -(per_seq * (reward - reward.mean())).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"seconds": None, "samples": None, "start": statistics.mean(rates[:SPAN]) if rates else None,
            "reached": statistics.mean(rates[-SPAN:]) if rates else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads")
    ap.add_argument("--quick", action="store_true", help="one seed, a few steps: proves the row runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]
    steps = 2 * SPAN + 1 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / "model")
        runs = [time_to_double(model_dir, lr=args.lr, batch=args.batch, steps=steps, seed=s) for s in seeds]
    print(f"bare loop: tiny model, REINFORCE lr {args.lr:g}, batch {args.batch}, {args.threads} thread(s)")
    print(f"{'seed':>4} {'start':>6} {'reached':>8} {'seconds':>8} {'samples':>8}")
    for s, r in zip(seeds, runs):
        fmt = (lambda x, d=2: "-" if x is None else f"{x:.{d}f}")
        print(f"{s:>4} {fmt(r['start']):>6} {fmt(r['reached']):>8} {fmt(r['seconds'], 1):>8} "
              f"{'-' if r['samples'] is None else r['samples']:>8}")
    done = [r["seconds"] for r in runs if r["seconds"] is not None]
    value = statistics.median(done) if done else None
    note = (f"median over seeds {seeds} of the seconds until the accept rate doubled "
            f"({len(done)} of {len(runs)} doubled within {steps} steps)")
    print(note)
    if args.json:
        args.json.write_text(json.dumps({"rows": [{"name": "bare in-process loop time-to-double", "value": value,
                                                   "unit": "s", "baseline": None, "ratio": None, "note": note,
                                                   "runs": runs}]}, indent=2))


if __name__ == "__main__":
    main()
