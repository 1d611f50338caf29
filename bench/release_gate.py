"""What the release gate costs per candidate: seconds to gate a version on the held-out prompts,
for the tiny built model and a larger one, on this machine's CPU (and its GPU when it has one).

    python bench/release_gate.py [--prompts 24] [--tokens 24]

Each row builds a model from a config (nothing is downloaded), writes a candidate whose weights
moved a little (as a training step moves them), and times ``release.gate.measure_gate`` in the
same process: load both versions, sample every prompt from each, one forward of each model per
answer for entropy and KL. The ratio column is each row's time over the tiny model's CPU time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flywheel.modelinit import ModelSpec, init_model
from release.gate import DEFAULT_PROMPTS, load_prompts, measure_gate

SIZES = {
    "tiny (the default model)": ModelSpec(),
    "small (hidden 512, 8 layers)": ModelSpec(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                                             num_kv_heads=4, vocab_size=2048),
}


def candidate_of(stable: Path, out: Path, scale: float = 1e-3) -> Path:
    """A copy of ``stable`` whose every weight moved by a small relative step."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(stable, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    moved = {k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=gen, dtype=v.dtype)
             for k, v in weights.items()}
    save_file(moved, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    prompts = (load_prompts(DEFAULT_PROMPTS) * 10)[:args.prompts]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        warm = init_model(Path(tmp) / "warm", ModelSpec())  # imports and first-call set-up, untimed
        measure_gate(warm, warm, prompts[:1], max_new_tokens=2, trainer_metrics={})
        for name, spec in SIZES.items():
            stable = init_model(Path(tmp) / f"{spec.hidden_size}-stable", spec)
            cand = candidate_of(stable, Path(tmp) / f"{spec.hidden_size}-candidate")
            for device in devices:
                if device == "cpu":
                    hidden = torch.cuda.is_available
                    torch.cuda.is_available = lambda: False  # the gate picks the GPU when there is one
                try:
                    t0 = time.perf_counter()
                    m = measure_gate(stable, cand, prompts, max_new_tokens=args.tokens, trainer_metrics={})
                    took = time.perf_counter() - t0
                finally:
                    if device == "cpu":
                        torch.cuda.is_available = hidden
                base = base or took
                rows.append((name, device, took, took / base, m.kl_from_stable, m.candidate_entropy))
    print(f"\n{len(prompts)} held-out prompts, up to {args.tokens} tokens each, candidate and stable\n")
    print(f"{'model':<30} {'device':<6} {'seconds':>8} {'vs tiny cpu':>11} {'KL':>8} {'entropy':>8}")
    for name, device, took, ratio, kl, ent in rows:
        print(f"{name:<30} {device:<6} {took:>8.2f} {ratio:>11.2f} {kl:>8.4f} {ent:>8.3f}")


if __name__ == "__main__":
    main()
