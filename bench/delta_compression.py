"""Delta size and apply time for consecutive versions from real training, across learning rates.

For each learning rate a fresh ~10.5M-parameter Llama is trained with real DeepSpeed AdamW steps
(one published version per step, weights served in bf16) and each consecutive pair of versions is
encoded three ways:

* ``naive``  dense XOR of the raw bits + zstd (the baseline to beat),
* ``ours``   flywheel/checkpoints/delta.py: gaps between changed values + zig-zag differences in byte planes,
* ``dense``  zstd of the full weights (what shipping a full checkpoint compressed costs).

Every delta is applied and checked bit-exact. Times, all from local disk with a warm page cache:
``load`` = read the full file + sha256 (what a full version costs to verify); ``apply`` = read the
delta + apply it to the parent in memory + sha256 of the result; ``inplace`` = read the delta +
sha256 of the delta + apply it in place to a host copy of the (already verified) parent.
Deserialising the bytes into tensors afterwards costs the same either way.

Goal (:data:`GOAL`, which ``flywheel bench`` reads from the JSON and judges at 1e-5 and 1e-6, a
real model's learning rates): ``ours`` against ``naive``, the codec's reason to exist. Against the
uncompressed weights any delta looks good.

    .venv/bin/python bench/delta_compression.py [--versions 3] [--lrs 1e-6,1e-5,1e-4,3e-3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flywheel.checkpoints import delta as D
from flywheel.contracts import RewardEvent, SamplingParams
from flywheel.modelinit import ModelSpec, init_model
from trainer import dist
from trainer.losses import LossConfig
from trainer.policy import Policy, default_ds_config

#: Our delta's bytes over the XOR+zstd delta's, at most: 1.5x smaller, or the codec is not worth its
#: code (3 versions on 2 cores: 0.55 at lr 1e-5, 0.48 at 1e-6).
GOAL = "<= 0.67"
SPEC = ModelSpec(vocab_size=512, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=6)
PROMPTS = [[1, 4, 30 + i] for i in range(8)]


def batch(policy: Policy, step: int) -> list[RewardEvent]:
    out = policy.sample(PROMPTS, max_new_tokens=16)
    return [
        RewardEvent(
            generation_id=f"{step}-{i}", group_id="g", user_id="u", model_version=0, signal="accept",
            prompt_token_ids=tuple(p), completion_token_ids=tuple(t), logprobs=tuple(lp),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16),
            reward=sum(x < 200 for x in t) / len(t), generated_at=0.0, labeled_at=0.0,
        )
        for i, (p, (t, lp)) in enumerate(zip(PROMPTS, out))
    ]


def timed(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure_pair(parent: bytes, child: bytes, tmp: Path) -> dict[str, float]:
    """Sizes, plus the time to get verified new weights bytes either way, both from local disk:
    full = read the full file + sha256 against the manifest; apply = read the delta + apply it
    to the (already verified) parent in memory + sha256 of the result."""
    ours = D.make_delta(parent, child, parent_version=0)
    naive = D.naive_xor(parent, child)
    want = hashlib.sha256(child).hexdigest()
    full_path, delta_path, naive_path = tmp / "full.safetensors", tmp / "delta.fwd", tmp / "naive.xor"
    full_path.write_bytes(child)
    delta_path.write_bytes(ours)
    naive_path.write_bytes(naive)

    def via_delta() -> bytes:
        out = D.apply_delta(parent, delta_path.read_bytes(), check_parent=False)
        assert hashlib.sha256(out).hexdigest() == want
        return out

    def via_naive() -> bytes:
        out = D.naive_xor_apply(parent, naive_path.read_bytes())
        assert hashlib.sha256(out).hexdigest() == want
        return out

    def via_full() -> bytes:
        out = full_path.read_bytes()
        assert hashlib.sha256(out).hexdigest() == want
        return out

    want_delta = hashlib.sha256(ours).hexdigest()

    def via_delta_inplace() -> bytes:
        # Integrity from the inputs: the parent was verified when it was loaded, the delta file is
        # checked against its manifest hash, and decoding is deterministic; re-hashing the output
        # (the "apply" column) only guards against a codec bug.
        blob = delta_path.read_bytes()
        assert hashlib.sha256(blob).hexdigest() == want_delta
        return D.apply_delta_inplace(host, blob)

    t_ours, rebuilt = timed(via_delta)
    t_inplace = float("inf")
    for _ in range(3):  # a fresh host copy of the parent each time (serving keeps one resident)
        host = bytearray(parent)
        t, rebuilt_inplace = timed(via_delta_inplace, repeat=1)
        t_inplace = min(t_inplace, t)
    assert rebuilt_inplace == child
    t_naive, rebuilt_naive = timed(via_naive)
    t_load, _ = timed(via_full)
    assert rebuilt == child and rebuilt_naive == child, "delta is not bit-exact"
    _, p_data, _ = D.split_safetensors(parent)
    _, c_data, _ = D.split_safetensors(child)
    same = float(np.mean(np.frombuffer(p_data, np.uint16) == np.frombuffer(c_data, np.uint16)))
    return {
        "full": len(child), "ours": len(ours), "naive": len(naive), "unchanged": same,
        "t_ours": t_ours, "t_inplace": t_inplace, "t_naive": t_naive, "t_load": t_load,
    }


def run_lr(model_dir: Path, lr: float, versions: int, tmp: Path) -> dict[str, float]:
    torch.manual_seed(0)
    policy = Policy.load(model_dir, default_ds_config(8, 1), LossConfig(name="reinforce", entropy_coef=0.01, kl_coef=0.0), lr=lr)
    publish = lambda: save(policy.publish_weights(torch.bfloat16))
    prev, rows = publish(), []
    for step in range(versions):
        policy.forward_backward(batch(policy, step))
        policy.step()
        cur = publish()
        rows.append(measure_pair(prev, cur, tmp))
        prev = cur
    agg = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    agg["dense"] = len(zstandard.ZstdCompressor(level=3).compress(prev))
    agg["params"] = sum(p.numel() for p in policy.module.parameters())
    return agg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4,3e-3")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    dist.init()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = init_model(tmp / "model", SPEC)
        results = {lr: run_lr(model_dir, float(lr), args.versions, tmp) for lr in args.lrs.split(",")}
    first = next(iter(results.values()))
    print(f"\nmodel: {first['params'] / 1e6:.1f}M parameters, bf16 weights {first['full'] / 1e6:.1f} MB; "
          f"dense zstd of full weights: {first['full'] / first['dense']:.2f}x; {args.versions} versions per lr")
    print(f"{'lr':>7} | {'unchanged':>9} | {'naive B':>10} {'naive x':>8} | {'ours B':>10} {'ours x':>8} | "
          f"{'ours/naive':>10} | {'apply ms':>8} {'inplace':>8} {'naive ms':>8} {'load ms':>8} | {'load/apply':>10} {'load/inpl':>9}")
    for lr, r in results.items():
        print(f"{lr:>7} | {r['unchanged'] * 100:8.1f}% | {r['naive']:>10.0f} {r['full'] / r['naive']:7.1f}x | "
              f"{r['ours']:>10.0f} {r['full'] / r['ours']:7.1f}x | {r['naive'] / r['ours']:9.2f}x | "
              f"{r['t_ours'] * 1e3:8.1f} {r['t_inplace'] * 1e3:8.1f} {r['t_naive'] * 1e3:8.1f} {r['t_load'] * 1e3:8.1f} | "
              f"{r['t_load'] / r['t_ours']:9.2f}x {r['t_load'] / r['t_inplace']:8.2f}x")
    print(f"all deltas bit-exact (checked); goal: ours/naive bytes {GOAL}")
    if args.json:
        args.json.write_text(json.dumps({"params": first["params"], "lrs": results, "goal": GOAL}, indent=2))


if __name__ == "__main__":
    main()
