"""The trainer's policy step, LoRA against full fine-tuning, on a model of SmolLM2-135M's shape.

The model is built from SmolLM2-135M-Instruct's configuration alone (random weights: a step costs
the same whatever the weights hold), so this runs where the real weights are not, a GPU machine
included. Each mode runs the trainer's own code: :meth:`trainer.policy.Policy.on_model` (PEFT
wrapping, torch AdamW under DeepSpeed ZeRO-0, clipping 1.0) and ``forward_backward`` + ``step``
on batches shaped like the real-model demo's (local/demo-real.toml: 8 samples a step, REINFORCE,
entropy bonus 0.01, no KL term; prompt plus completion about 48 tokens). LoRA is rank 8, alpha 16
on every linear layer but the head, the demo's adapter.

Precision: float32 on the CPU (as the trainer runs there); bfloat16 on CUDA through DeepSpeed's
``bf16`` (bf16 weights and activations, float32 master weights and AdamW state for what trains).
``--engine torch`` replaces DeepSpeed by a plain torch AdamW step (clipping 1.0) on the same PEFT
model, in pure bfloat16 on CUDA, for a machine where DeepSpeed does not run.

Each mode runs in a process of its own, so its peak memory is its own: on CUDA
``torch.cuda.max_memory_allocated``, on the CPU the process's peak resident set (which includes
the interpreter and libraries; the ``floor`` column is the resident set before the model).

    .venv/bin/python bench/lora_step.py --device cpu --warmup 1 --steps 3
    python3 bench/lora_step.py --device cuda --warmup 5 --steps 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: SmolLM2-135M-Instruct's config.json (what ``flywheel model import`` writes for it), the fields
#: that decide the model's shape and cost.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
#: The demo's step sizes (local/demo-real.toml): the adapter's, and a whole-weight run's.
LR = {"full": 3e-5, "lora": 1e-3}


def events(batch: int, prompt: int, completion: int, vocab: int, seed: int) -> list[Any]:
    """``batch`` reward records of random tokens, half accepted: the trainer's input, as decoded."""
    import random

    from flywheel.contracts import RewardEvent, SamplingParams

    rng = random.Random(seed)
    return [
        RewardEvent(
            generation_id=f"gen-{i}", group_id=f"grp-{i}", user_id=f"user-{i}", model_version=0,
            signal="accept" if i % 2 else "reject",
            prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt)),
            completion_token_ids=tuple(rng.randrange(3, vocab) for _ in range(completion)),
            logprobs=tuple(-rng.uniform(0.5, 8.0) for _ in range(completion)),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=completion),
            reward=float(i % 2), generated_at=0.0, labeled_at=0.0,
        )
        for i in range(batch)
    ]


class TorchEngine:
    """What :class:`~trainer.policy.Policy` calls on a DeepSpeed engine, done by torch alone."""

    def __init__(self, module: Any, lr: float, device: Any) -> None:
        import torch

        self.module = module.to(device)
        self.device = device
        self.opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)

    def __call__(self, **kw: Any) -> Any:
        return self.module(**kw)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: Any) -> None:
        loss.backward()

    def step(self) -> None:
        import torch

        torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this process: build, warm up, time; the result as a dict."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import dist
    from trainer.losses import LossConfig
    from trainer.policy import LoraSpec, Policy, default_ds_config

    cuda = args.device == "cuda"
    floor = rss_mib()
    torch.manual_seed(0)
    lora = LoraSpec(args.rank, args.alpha, ("all-linear",)) if args.one == "lora" else None
    loss_cfg = LossConfig("reinforce", entropy_coef=0.01, kl_coef=0.0)
    config = LlamaConfig(**SMOLLM2_135M)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with device:
        model = LlamaForCausalLM(config).float()
    if args.engine == "deepspeed":
        dist.init()
        ds = default_ds_config(args.batch, 1)
        ds["bf16"] = {"enabled": cuda}
        policy = Policy.on_model(model, ds, loss_cfg, lr=LR[args.one], lora=lora, pad_id=config.pad_token_id)
    else:
        if cuda:
            model = model.to(torch.bfloat16)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora.peft_config())
        policy = Policy(TorchEngine(model, LR[args.one], device), config.pad_token_id, loss_cfg, None, lora)
    trainable = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.module.parameters())
    batch = events(args.batch, args.prompt_tokens, args.completion_tokens, config.vocab_size, seed=1)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        stats = policy.forward_backward(batch)
        if "nonfinite" in stats:
            raise SystemExit(f"{args.one}: a non-finite loss at step {i}")
        policy.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    p50 = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.shutdown()
    return {
        "mode": args.one, "engine": args.engine, "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": "bfloat16" if cuda else "float32", "threads": torch.get_num_threads(),
        "trainable_params": trainable, "total_params": total,
        "step_p50_s": p50, "step_min_s": min(times), "step_max_s": max(times), "steps": len(times),
        "samples_per_s": args.batch / p50, "peak_mib": peak, "floor_mib": None if cuda else floor,
        "last_loss": stats["loss"],
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    full, lora = rows["full"], rows["lora"]
    mem = "peak GPU memory (MiB)" if full["device"] == "cuda" else "peak RSS (MiB)"
    head = f"{full['device_name']}, {full['dtype']}, {full['engine']}, {full['steps']} timed steps"
    lines = [head, "", f"| | trainable params | step p50 (s) | samples/s | {mem} |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in (full, lora):
        lines.append(f"| {r['mode']} | {r['trainable_params']:,} | {r['step_p50_s']:.3f} | {r['samples_per_s']:.1f} | "
                     f"{r['peak_mib']:,.0f} |")
    lines.append(f"| LoRA/full | {lora['trainable_params'] / full['trainable_params']:.4f} | "
                 f"{lora['step_p50_s'] / full['step_p50_s']:.2f} | {lora['samples_per_s'] / full['samples_per_s']:.2f} | "
                 f"{lora['peak_mib'] / full['peak_mib']:.2f} |")
    if full["floor_mib"] is not None:
        lines.append(f"\nRSS before the model: {full['floor_mib']:,.0f} MiB (interpreter and libraries); "
                     f"{full['threads']} torch threads")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--engine", choices=("deepspeed", "torch"), default="deepspeed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--completion-tokens", type=int, default=24)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--json", type=Path, help="write both modes' results here")
    ap.add_argument("--one", choices=("full", "lora"), help=argparse.SUPPRESS)  # a child: one mode, JSON out
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    rows = {}
    for mode in ("full", "lora"):
        # a process per mode: peak memory (GPU or RSS) is that mode's alone
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        rows[mode] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
