"""Logprob gap: the trainer's logprob of each sampled token against the one vLLM recorded.

    .venv/bin/python bench/logprob_gap.py [--prompts 64] [--max-tokens 32] [--quick] [--json PATH]

On the locally built tiny model (fp32 weights), ``vllm.LLM`` samples completions at temperature 1
with ``logprobs=0`` in ``processed_logprobs`` mode (serving's settings), so each sampled token comes
with the logprob vLLM drew it from. The trainer's :class:`~trainer.policy.Policy` (DeepSpeed,
fp32, same weights, no step taken) then scores the same prompt+completion tokens through
``Policy.logprobs``: the path ``forward_backward`` takes for the loss (``collate`` +
``token_logprobs``, right-padded batches). The rows are mean, p99 and max of
``|trainer - vLLM|`` over every completion token, in nats.

Baseline: a plain transformers forward of each sequence alone (no DeepSpeed, no padding, no
batching) against the same vLLM logprobs. That is the numerical floor of "another fp32
implementation of the same model versus vLLM's CPU kernels"; trainer/baseline near 1 means the
trainer's own path (padding, masks, temperature division, DeepSpeed wrapper) adds nothing to the
gap. One more row gives the trainer against that plain forward directly (its own contribution).
A last row repeats the vLLM side with ``dtype="auto"``, serving's default (``ServeSettings.dtype``):
vLLM downcasts fp32 checkpoints to its platform's preferred half type, so that row prices what
serving at default settings does to the gap. Goal: mean gap below 0.01 nats per token in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

GOAL_NATS = 0.01


def sample(model_dir: Path, prompts: list[list[int]], max_tokens: int,
           dtype: str) -> tuple[list[tuple[list[int], list[float]]], str]:
    """``(completion ids, vLLM logprob of each)`` per prompt and the dtype the engine ran in; the
    engine is shut down after (its process group must go before the next one or DeepSpeed's)."""
    import gc

    from vllm import LLM, SamplingParams

    # engine settings as serving's (enforce_eager, processed logprobs, the worker hook); "uni" keeps
    # the worker in this process: the numbers are the same and each engine skips two process spawns
    # that re-import vLLM (~15 s each on a loaded 2-core machine)
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, logprobs_mode="processed_logprobs",
              max_num_seqs=len(prompts), disable_log_stats=True, seed=0, distributed_executor_backend="uni",
              worker_extension_cls="serving.vllm_worker.WorkerSetup")
    # ignore_eos: every completion is max_tokens long, so every row scores the same number of tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out = []
    for r in results:
        c = r.outputs[0]
        out.append((list(c.token_ids), [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)]))
    ran = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    llm.llm_engine.engine_core.shutdown()  # free the engine's process and KV cache before the next
    del llm
    gc.collect()
    return out, ran


def events(prompts: list[list[int]], samples: list[tuple[list[int], list[float]]]) -> list:
    from flywheel.contracts import RewardEvent, SamplingParams

    return [RewardEvent(generation_id=f"gen-{i}", group_id=f"grp-{i}", user_id="bench", model_version=0,
                        signal="accept", prompt_token_ids=tuple(p), completion_token_ids=tuple(c),
                        logprobs=tuple(lp), sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=len(c)),
                        reward=0.0, generated_at=0.0, labeled_at=0.0)
            for i, (p, (c, lp)) in enumerate(zip(prompts, samples))]


def trainer_logprobs(policy, evs: list, batch: int) -> list[torch.Tensor]:
    """Per sample, the trainer's logprob of each completion token, through ``Policy.logprobs``."""
    out = []
    for i in range(0, len(evs), batch):
        chunk = evs[i : i + batch]
        lp = policy.logprobs(chunk)  # [B, L-1], completion positions only
        for row, e in zip(lp, chunk):
            p, c = len(e.prompt_token_ids), len(e.completion_token_ids)
            out.append(row[p - 1 : p - 1 + c].cpu())  # logits at p-1 predict the first completion token
    return out


@torch.no_grad()
def plain_logprobs(model_dir: Path, evs: list) -> list[torch.Tensor]:
    """The same scores from a bare transformers model, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for e in evs:
        ids = torch.tensor([[*e.prompt_token_ids, *e.completion_token_ids]])
        logsm = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        p = len(e.prompt_token_ids)
        out.append(logsm[p - 1 :].gather(-1, ids[0, p:, None]).squeeze(-1))
    return out


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)]).double()
    return {"mean": float(d.mean()), "p99": float(torch.quantile(d, 0.99)), "max": float(d.max()), "tokens": d.numel()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="trainer scoring batch (right-padded like training)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves every row runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.batch = 4, 8, 4

    from transformers import AutoTokenizer

    from flywheel.modelinit import ModelSpec, init_model, synthetic_corpus
    from flywheel.settings import ServeSettings
    from serving.engine import configure_vllm_env
    from trainer import dist
    from trainer.losses import LossConfig
    from trainer.policy import Policy, default_ds_config

    configure_vllm_env(ServeSettings())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process too (see sample)
    model_dir = init_model(Path(tempfile.mkdtemp(prefix="bench-gap-model-")) / "model", ModelSpec())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # prompts of different lengths, so the trainer's right padding is exercised
    prompts = [tok.encode(line, add_special_tokens=True)[:48] for line in synthetic_corpus(lines=args.prompts, seed=7)]
    fp32 = events(prompts, sample(model_dir, prompts, args.max_tokens, "float32")[0])
    auto_samples, auto_dtype = sample(model_dir, prompts, args.max_tokens, "auto")
    auto = events(prompts, auto_samples)

    dist.init()
    dist.cpu_threads(1)
    # kl_coef 0: no reference model is loaded, the scoring path is the same either way
    policy = Policy.load(model_dir, default_ds_config(args.batch, 1), LossConfig("reinforce", kl_coef=0.0), lr=1e-5)
    vllm_fp32 = [torch.tensor(e.logprobs) for e in fp32]
    trainer, plain = trainer_logprobs(policy, fp32, args.batch), plain_logprobs(model_dir, fp32)
    vs_vllm, floor, own = gap(trainer, vllm_fp32), gap(plain, vllm_fp32), gap(trainer, plain)
    vs_auto = gap(trainer_logprobs(policy, auto, args.batch), [torch.tensor(e.logprobs) for e in auto])
    # on a random-init model the next-token distributions are near uniform (logprob ~ -ln V): the
    # note carries the mean, since peaked distributions of a trained model can widen the gap
    mean_lp = float(torch.cat(vllm_fp32).mean())
    report(args, vs_vllm, floor, own, vs_auto, auto_dtype, mean_lp)


def report(args: argparse.Namespace, vs_vllm: dict, floor: dict, own: dict, vs_auto: dict, auto_dtype: str,
           mean_lp: float) -> None:
    met = "met" if vs_vllm["mean"] < GOAL_NATS else "NOT met"
    rows = [{"name": f"trainer vs vLLM fp32 logprob gap, {k}", "value": vs_vllm[k], "unit": "nats/token",
             "baseline": floor[k], "ratio": vs_vllm[k] / floor[k] if floor[k] else None,
             "note": (f"{vs_vllm['tokens']} completion tokens at temperature 1, mean sampled logprob "
                      f"{mean_lp:.2f} (random-init model, near uniform); baseline: plain transformers "
                      f"forward, one unpadded sequence at a time, vs the same vLLM logprobs"
                      + (f"; goal mean < {GOAL_NATS} nats: {met}" if k == "mean" else ""))}
            for k in ("mean", "p99", "max")]
    rows.append({"name": "trainer vs plain transformers logprob gap, max", "value": own["max"], "unit": "nats/token",
                 "baseline": None, "ratio": None,
                 "note": f"the trainer path's own contribution (padding, masks, DeepSpeed); mean {own['mean']:.2e}"})
    rows.append({"name": "trainer vs vLLM dtype=auto logprob gap, mean", "value": vs_auto["mean"], "unit": "nats/token",
                 "baseline": None, "ratio": None,  # against ~1e-7 in fp32 a ratio is only noise
                 "note": (f"serving's default dtype: vLLM downcasts an fp32 checkpoint to its preferred half type "
                          f"({auto_dtype} here); p99 {vs_auto['p99']:.4f}, max {vs_auto['max']:.4f}, "
                          f"against {vs_vllm['mean']:.1e} with the fp32 engine")})
    print(f"\n{args.prompts} prompts x {args.max_tokens} sampled tokens, trainer batch {args.batch}")
    print(f"{'row':<48} {'nats/token':>11} {'baseline':>11} {'ratio':>7}")
    for r in rows:
        base = "-" if r["baseline"] is None else f"{r['baseline']:.2e}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['name']:<48} {r['value']:>11.2e} {base:>11} {ratio:>7}")
    print(f"goal mean gap < {GOAL_NATS} nats/token in fp32: {met}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
