"""Pipelined trainer: generation and training overlapped, against generate-then-train in turn.

    .venv/bin/python bench/pipelined_trainer.py [--batches 8] [--batch 16] [--max-tokens 32] [--rounds 3]
                                                [--quick] [--json PATH]

One run, on the locally built tiny model: a child process (spawn) holds a ``vllm.LLM`` with
serving's engine settings (so dtype "auto": bfloat16 on most CPUs, while the trainer is fp32; the
engine core and worker run inside that child rather than in two more processes) and answers "generate batch i" requests over a queue with token ids,
logprobs and text; this process holds the trainer's :class:`~trainer.policy.Policy` (DeepSpeed on
the CPU, the service's loss settings) and runs ``forward_backward`` + ``step`` on each batch, the
reward being the share of vowels in the completion text (the point is throughput, not learning).

* ``synchronous`` (baseline): request batch i, wait for it, train on it, then request batch i+1;
  the generator idles while the trainer trains and the other way round.
* ``pipelined``: batch i+1 is already requested when batch i arrives, so vLLM generates it while
  the trainer trains on batch i (one batch of lookahead, the one-step off-policy lag of
  PipelineRL-style trainers). No weights flow back to the generator here: the bench prices the
  overlap, not the weight sync.

Both modes run the same ``--batches`` batches of the same prompts with the same generator and
policy; every completion is ``--max-tokens`` long (``ignore_eos``) so every batch is the same
work. Rounds alternate the modes so other load on the machine hits both alike; the table takes
each mode's fastest round. Also shown, from the synchronous rounds: each stage's rate alone and
the ideal overlap bound ``samples / max(generation time, training time)``. Expect little gain
when both stages share the same few cores: vLLM pins its thread to one core ("auto" binding),
the trainer uses one intra-op thread, so on 2 cores the overlap is real only if nothing else runs.

Goal (:data:`GOAL`, which ``flywheel bench`` reads from the JSON): pipelined at least 1.2x the
synchronous rate. Overlap is the reason the trainer pipelines at all; "not slower" would pass a
pipeline that overlaps nothing. Where the stages share too few cores to overlap, the row says NO.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Pipelined samples/s over synchronous: a real gain from overlapping generation with training.
GOAL = ">= 1.2"
#: One generated sample, generator -> trainer: prompt ids, completion ids, vLLM logprobs, text.
Sample = tuple[list[int], list[int], list[float], str]


def generator(batch: int, max_tokens: int, requests: Any, results: Any) -> None:
    """Child process: one vLLM engine; answers batch index i with ``batch`` samples, None stops it.

    The first request carries the model directory and the prompts: the child is started before
    they exist so that importing vLLM here overlaps with building the model in the parent.
    """
    from vllm import LLM, SamplingParams

    model_dir, prompts = requests.get()

    # serving's engine settings; the "uni" executor and in-process engine core keep the whole
    # engine in this one process (same kernels, two fewer spawns that each re-import vLLM)
    llm = LLM(model=model_dir, enforce_eager=True, logprobs_mode="processed_logprobs", max_num_seqs=batch,
              disable_log_stats=True, seed=0, distributed_executor_backend="uni",
              worker_extension_cls="serving.vllm_worker.WorkerSetup")
    # ignore_eos: every completion has max_tokens tokens, so every batch is the same work
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)  # warm-up
    results.put("ready")
    while (i := requests.get()) is not None:
        chunk = prompts[(i * batch) % len(prompts):][:batch]
        out: list[Sample] = []
        for r in llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False):
            c = r.outputs[0]
            out.append((list(r.prompt_token_ids), list(c.token_ids),
                        [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)], c.text))
        results.put(out)


def vowel_share(text: str) -> float:
    letters = [ch for ch in text.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0


def to_events(samples: list[Sample], max_tokens: int) -> list:
    from flywheel.contracts import RewardEvent, SamplingParams

    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    return [RewardEvent(generation_id=f"gen-{i}", group_id=f"grp-{i}", user_id="bench", model_version=0,
                        signal="accept", prompt_token_ids=tuple(p), completion_token_ids=tuple(c), logprobs=tuple(lp),
                        sampling=sampling, reward=vowel_share(text), generated_at=0.0, labeled_at=0.0)
            for i, (p, c, lp, text) in enumerate(samples)]


@dataclass
class Run:
    wall: float  # first request to last step, s
    wait: float  # trainer blocked on the generator, s
    train: float  # forward_backward + step, s
    samples: int

    @property
    def rate(self) -> float:
        return self.samples / self.wall


def run(policy, requests: Any, results: Any, batches: int, max_tokens: int, pipelined: bool) -> Run:
    """``batches`` train steps on generated batches; pipelined keeps one more batch in flight.

    Both modes ask for the next batch once a step is done; pipelined starts with two requested,
    so while the trainer trains on batch i the generator works on batch i+1 (never further
    ahead: samples are at most one step off-policy, as they would be with a weight sync per step).
    """
    t0 = time.perf_counter()
    wait = train = 0.0
    sent = min(batches, 2 if pipelined else 1)
    for i in range(sent):
        requests.put(i)
    for _ in range(batches):
        t = time.perf_counter()
        evs = to_events(results.get(timeout=600), max_tokens)  # raises if the generator died
        wait += time.perf_counter() - t
        t = time.perf_counter()
        policy.forward_backward(evs)
        policy.step()
        train += time.perf_counter() - t
        if sent < batches:
            requests.put(sent)
            sent += 1
    return Run(time.perf_counter() - t0, wait, train, batches * len(evs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8, help="train steps per mode per round")
    ap.add_argument("--batch", type=int, default=16, help="samples per batch (generated and trained)")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per sample")
    ap.add_argument("--rounds", type=int, default=3, help="alternating synchronous/pipelined rounds")
    ap.add_argument("--threads", type=int, default=1, help="trainer intra-op threads (TrainerSettings.cpu_threads)")
    ap.add_argument("--bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for the generator")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves every row runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.batch, args.max_tokens, args.rounds = 2, 4, 8, 1

    from transformers import AutoTokenizer

    from flywheel.modelinit import ModelSpec, init_model, synthetic_corpus
    from flywheel.settings import ServeSettings, TrainerSettings
    from serving.engine import configure_vllm_env

    configure_vllm_env(ServeSettings(cpu_threads_bind=args.bind))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs inside the generator process
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    # started first: it imports vLLM while the model is built and the trainer loads here, and it
    # must not inherit the RANK/MASTER_* variables DeepSpeed's set-up writes into this environment
    child = ctx.Process(target=generator, args=(args.batch, args.max_tokens, requests, results))
    child.start()
    try:
        model_dir = init_model(Path(tempfile.mkdtemp(prefix="bench-pipe-model-")) / "model", ModelSpec())
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [tok.encode(line, add_special_tokens=True)[:48]
                   for line in synthetic_corpus(lines=args.batches * args.batch, seed=11)]
        requests.put((str(model_dir), prompts))
        policy = load_policy(model_dir, args.batch, args.threads, TrainerSettings(loss="reinforce"))
        if results.get(timeout=600) != "ready":
            raise RuntimeError("generator failed to start")
        run(policy, requests, results, 1, args.max_tokens, pipelined=False)  # warm-up step, untimed
        sync, pipe = [], []
        for _ in range(args.rounds):
            sync.append(run(policy, requests, results, args.batches, args.max_tokens, pipelined=False))
            pipe.append(run(policy, requests, results, args.batches, args.max_tokens, pipelined=True))
    finally:
        requests.put(None)
        child.join(timeout=60)
        if child.is_alive():
            child.terminate()
    report(args, sync, pipe)


def load_policy(model_dir: Path, batch: int, threads: int, t: Any) -> Any:
    """The trainer's Policy as the service builds it (as bench/trainer_throughput.py's ``bare``)."""
    from trainer import dist
    from trainer.losses import LossConfig
    from trainer.policy import Policy, default_ds_config

    dist.init()
    dist.cpu_threads(threads)
    return Policy.load(model_dir, default_ds_config(batch, 1),
                       LossConfig(t.loss, entropy_coef=t.entropy_coef, kl_coef=t.kl_coef), lr=t.lr)


def report(args: argparse.Namespace, sync: list[Run], pipe: list[Run]) -> None:
    s, p = max(sync, key=lambda r: r.rate), max(pipe, key=lambda r: r.rate)
    paired = [b.rate / a.rate for a, b in zip(sync, pipe)]
    gen_rate, train_rate = s.samples / s.wait, s.samples / s.train  # the stages alone, from the sync run
    ideal = s.samples / max(s.wait, s.train)
    verdict = "gains" if p.rate > 1.05 * s.rate else ("loses" if p.rate < 0.95 * s.rate else "is even")
    size = (f"{args.batches} batches x {args.batch} samples x {args.max_tokens} tokens, "
            f"best of {args.rounds} alternating round(s), {os.cpu_count()} CPUs")
    rows = [
        {"name": "pipelined vs synchronous trainer", "value": p.rate, "unit": "samples/s", "baseline": s.rate,
         "ratio": p.rate / s.rate, "goal": GOAL,
         "note": (f"{size}; pipelining {verdict} here (per round, synchronous {[round(r.rate, 1) for r in sync]}, "
                  f"pipelined {[round(r.rate, 1) for r in pipe]} samples/s; paired ratios "
                  f"{[round(r, 2) for r in paired]}); the "
                  f"trainer still waited {p.wait / p.wall:.0%} of pipelined wall time; both stages share the "
                  f"same cores, so the overlap is bounded by contention, not only by the slower stage")},
        {"name": "generation stage alone (vLLM)", "value": gen_rate, "unit": "samples/s", "baseline": None,
         "ratio": None, "note": "the trainer's wait per batch in the fastest synchronous round"},
        {"name": "training stage alone (DeepSpeed)", "value": train_rate, "unit": "samples/s", "baseline": None,
         "ratio": None, "note": f"forward_backward + step, {args.threads} intra-op thread(s), reinforce loss"},
        {"name": "ideal overlap bound vs synchronous", "value": ideal, "unit": "samples/s", "baseline": s.rate,
         "ratio": ideal / s.rate,
         "note": "samples / max(generation, training) time: what pipelining could reach with a core per stage"},
    ]
    print(f"\n{size}")
    print(f"{'row':<36} {'samples/s':>10} {'baseline':>9} {'ratio':>6}")
    for r in rows:
        base = "-" if r["baseline"] is None else f"{r['baseline']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['name']:<36} {r['value']:>10.1f} {base:>9} {ratio:>6}")
    print(f"paired rounds pipelined/synchronous: median {statistics.median(paired):.2f}; goal: ratio {GOAL}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
