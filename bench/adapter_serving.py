"""Adapter versions on one engine against full-weight versions on two: memory, throughput, p95
latency during swaps, release to answering; latency around the first adapter going live; and the
logprob gap between PEFT and vLLM's LoRA.

    .venv/bin/python bench/adapter_serving.py [--seconds 15] [--concurrency 16] [--json PATH]
    .venv/bin/python bench/adapter_serving.py --model-dir DIR --first-adapter-only   # a real model

Two rigs of bench/weight_swap.py's kind, one after the other in this process, each serving the
locally built tiny model against an embedded broker with the release follower and the API:

- ``full``: two vLLM engines (``serve.lora=off``), versions that are full weights;
- ``adapters``: ONE engine with vLLM's LoRA support (``serve.lora=on``), versions that are LoRA
  adapters (rank 8 on every linear layer, random B) on the same base.

Each rig: stable and a canary at share 0.5 (resident memory of every process taken then, and
``--seconds`` of closed-loop load: throughput and p95 without swaps); then the same load while
both routes are replaced every ``--swap-every`` s (p95 during swaps, and release record to the new
version answering a pinned request). Both run at ``--dtype`` (float32: the logprob gap row is an
fp32 row like bench/logprob_gap.py's). Last, pinned requests at temperature 1 to an adapter
version against the PEFT model (unmerged, as the trainer holds it) scoring the same tokens: the
mean and max |gap| per token. Goals: memory at most 0.7 of two engines, throughput at least that of
two engines, p95 during swaps and release-to-answering no worse, mean gap under 0.01 nats.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_swap import KEY, Rig, build_store, pct, tree_rss_gib

GAP_GOAL_NATS = 0.01


def build_adapter_store(model_dir: Path, root: Path, n: int, rank: int = 8):
    """Adapter versions 1..n on ``model_dir`` (PEFT LoRA, random B), committed as the trainer does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flywheel.checkpoints import CheckpointStore
    from flywheel.checkpoints.manifest import MANIFEST_NAME, Adapter, sha256_file

    store = CheckpointStore(root)
    base_sha = sha256_file(model_dir / MANIFEST_NAME)
    for v in range(1, n + 1):
        torch.manual_seed(v)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        tmp = Path(tempfile.mkdtemp(prefix=f"adapter-{v}-"))
        model.save_pretrained(str(tmp))
        (tmp / "README.md").unlink(missing_ok=True)
        targets = tuple(sorted(model.peft_config["default"].target_modules))
        store.commit(tmp, version=v, parent=v - 1 if v > 1 else None, source_dir=model_dir, extra={}, ledger={},
                     adapter=Adapter(model_dir.name, base_sha, rank, float(2 * rank), targets))
    return store


class AdapterRig(Rig):
    """The same rig on one engine with LoRA, its slots adapter views (serving/adapters.py)."""

    def build_fleet(self, serve, model_dir: Path):
        from serving.adapters import adapter_slots
        from serving.engine import VllmEngine
        from serving.versions import Fleet

        async def build():
            return VllmEngine(serve, model_dir, lora=True)

        self.engines = [self.loop.call(build)]
        self.rss_one = self.rss_two = tree_rss_gib()
        return Fleet(adapter_slots(self.engines[0], model_dir), self.registry)

    def ref(self, v: int):
        from flywheel.checkpoints import adapter_of
        from flywheel.contracts import BaseModelRef

        ref = super().ref(v)
        if ref is None:
            return None
        a = adapter_of(self.store.manifest(v))
        return ref.model_copy(update={"base": BaseModelRef(name=a.base_name, manifest_sha256=a.base_manifest_sha256)})


def first_adapter(rig: Rig, args: argparse.Namespace) -> dict:
    """The base model answering every user, then the first adapter going live as a canary for half
    of them, under the same closed-loop load (``--seconds`` each side): latency and throughput
    before the release against after it, and after it by the version that answered. A real
    model's demo saw its median latency go from 1.1 s to 41 s here (README, "A real small model")."""
    import threading

    released: list[float] = []

    def go() -> None:
        time.sleep(args.seconds + 2)  # the load's process starts (imports) meanwhile
        released.append(time.perf_counter())
        rig.release(0, 1, 0.5)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    run = rig.load(2 * args.seconds + 2)
    t.join()
    answering = rig.applies[-1]["answering"] if rig.applies else float("nan")
    at = released[0] - rig.load_t0  # the release, on the load's own clock
    before = [r for r in run if r[0] < at]
    after = [r for r in run if r[0] >= at]

    def stats(rows: list) -> dict:
        span = max((r[0] + r[1] for r in rows), default=0.0) - min((r[0] for r in rows), default=0.0)
        return {"requests": len(rows), "p50_s": pct([r[1] for r in rows], 0.5), "p95_s": pct([r[1] for r in rows], 0.95),
                "tokens_per_s": sum(r[3] for r in rows) / span if span > 0 else 0.0}

    return {"before": stats(before), "after": stats(after), "answering_s": answering,
            "after_base": stats([r for r in after if not str(r[2]).endswith("@v1")]),
            "after_adapter": stats([r for r in after if str(r[2]).endswith("@v1")])}


def run_rig(rig: Rig, args: argparse.Namespace, n: int) -> dict:
    rig.load(3)  # warm both routes' kernels, untimed
    rig.release(n, n - 1, 0.5)
    time.sleep(1.0)
    rss = tree_rss_gib()
    steady = rig.load(args.seconds)
    rig.applies.clear()
    swaps = rig.load(args.seconds, [(n - 2, n - 3, 0.5), (n, n - 1, 0.5)])

    def tps(run):
        return sum(r[3] for r in run) / args.seconds

    return {"rss_gib": rss, "tokens_per_s": tps(steady), "p95_s": pct([r[1] for r in steady], 0.95),
            "p95_swaps_s": pct([r[1] for r in swaps], 0.95), "swap_tokens_per_s": tps(swaps),
            "answering_p95_s": pct([a["answering"] for a in rig.applies], 0.95),
            "answering_p50_s": pct([a["answering"] for a in rig.applies], 0.5), "releases": len(rig.applies),
            "requests": len(steady) + len(swaps)}


def logprob_gap(rig: Rig, model_dir: Path, version: int, prompts: int, max_tokens: int) -> dict:
    """Served logprobs of sampled tokens on adapter ``version`` against PEFT's on the same tokens."""
    import httpx
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with httpx.Client(base_url=rig.server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        for i in range(prompts):
            body = {"model": f"flywheel@v{version}", "prompt": f"score item {i}", "max_tokens": max_tokens,
                    "temperature": 1.0, "seed": i, "ignore_eos": True}
            resp = c.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(rig.follower.cache.path(version))).eval()
    gaps = []
    events = _recorded(rig, prompts)
    with torch.no_grad():
        for ev in events:
            ids = list(ev.prompt_token_ids) + list(ev.completion_token_ids)
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            p = len(ev.prompt_token_ids)
            want = [lp[p - 1 + k, t].item() for k, t in enumerate(ev.completion_token_ids)]
            gaps += [abs(a - b) for a, b in zip(want, ev.logprobs)]
    gaps.sort()
    return {"mean": sum(gaps) / len(gaps), "max": gaps[-1], "p99": gaps[int(0.99 * (len(gaps) - 1))],
            "tokens": len(gaps)}


def _recorded(rig: Rig, n: int) -> list:
    """The last ``n`` pinned generations serving recorded on the generations topic."""
    from kafka import KafkaConsumer

    from flywheel.contracts import GenerationEvent, decode

    deadline = time.monotonic() + 30
    while True:  # the recorder publishes in the background
        consumer = KafkaConsumer(rig.topics.generations, bootstrap_servers=rig.settings.kafka.bootstrap,
                                 auto_offset_reset="earliest", consumer_timeout_ms=2000)
        events = [decode(GenerationEvent, r.value) for r in consumer]
        consumer.close()
        pinned = [e for e in events if e.route == "pinned" and e.prompt_text.startswith("score item")]
        if len(pinned) >= n or time.monotonic() > deadline:
            break
    return pinned[-n:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="load per phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--swap-every", type=float, default=1.5)
    p.add_argument("--bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (serving's default: auto)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gap-prompts", type=int, default=16)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a real model's directory (default: the small built model)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="serve.max_lora_rank (default: serving's); the adapters are rank 8")
    p.add_argument("--first-adapter-only", action="store_true",
                   help="only the first adapter going live (a real model's: the rest takes minutes)")
    args = p.parse_args()

    from flywheel.modelinit import ModelSpec, init_model
    from flywheel.settings import ServeSettings
    from local.broker import EmbeddedBroker
    from serving.engine import configure_vllm_env

    configure_vllm_env(ServeSettings(cpu_threads_bind=args.bind))
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    model_dir = args.model_dir or init_model(tmp / "model", ModelSpec())
    n = args.versions
    out: dict = {}
    with EmbeddedBroker() as broker:
        if args.first_adapter_only:  # a real model's first adapter, without the rest (minutes each)
            args.serve_overrides = {"dtype": args.dtype, "lora": "on",
                                    **({"max_lora_rank": args.max_lora_rank} if args.max_lora_rank else {})}
            args.topic_prefix = "bench-first."
            rig = AdapterRig(model_dir, build_adapter_store(model_dir, tmp / "first", 1), args, broker.bootstrap)
            try:
                rig.load(3)  # warm the base route's kernels, untimed
                out["first_adapter"] = first_adapter(rig, args)
            finally:
                rig.close()
            print(json.dumps(out, indent=2))
            if args.json:
                args.json.write_text(json.dumps(out, indent=2))
            return
        for mode, rig_cls, store in (("full", Rig, build_store(model_dir, tmp / "full", n)),
                                     ("adapters", AdapterRig, build_adapter_store(model_dir, tmp / "adapters", n))):
            args.serve_overrides = {"dtype": args.dtype, "lora": "on" if mode == "adapters" else "off"}
            args.topic_prefix = f"bench-{mode}."  # each rig follows releases of its own
            rig = rig_cls(model_dir, store, args, broker.bootstrap)
            try:
                if mode == "adapters":
                    rig.load(3)  # warm the base route's kernels, untimed
                    out["first_adapter"] = first_adapter(rig, args)
                out[mode] = run_rig(rig, args, n)
                if mode == "adapters":
                    rig.release(n, n - 1, 0.5)  # the swaps alternate: v{n} may be the one they left
                    out["gap"] = logprob_gap(rig, model_dir, n, args.gap_prompts, args.max_tokens)
            finally:
                rig.close()
    report(args, out)


def report(args: argparse.Namespace, out: dict) -> None:
    full, ad = out["full"], out["adapters"]
    print(f"\nconcurrency {args.concurrency}, {args.max_tokens} tokens per request, {args.seconds:.0f} s per phase, "
          f"a swap of both routes every {args.swap_every} s, dtype {args.dtype}")
    print(f"{'':<34} {'two full engines':>17} {'adapters, one engine':>21} {'ratio':>7}")
    for key, name in (("rss_gib", "resident memory, GiB"), ("tokens_per_s", "throughput, tokens/s"),
                      ("p95_s", "p95 latency, s"), ("p95_swaps_s", "p95 latency during swaps, s"),
                      ("answering_p95_s", "release to answering p95, s"),
                      ("answering_p50_s", "release to answering p50, s")):
        print(f"{name:<34} {full[key]:>17.3f} {ad[key]:>21.3f} {ad[key] / full[key]:>7.2f}")
    f = out["first_adapter"]
    print(f"first adapter live (base for every user, then v1 for half; answering {f['answering_s']:.2f} s after "
          f"its release):")
    for key, name in (("p50_s", "p50 latency, s"), ("p95_s", "p95 latency, s"), ("tokens_per_s", "throughput, tokens/s")):
        print(f"  {name:<32} before {f['before'][key]:>8.3f}  after {f['after'][key]:>8.3f}  "
              f"ratio {f['after'][key] / f['before'][key]:>5.2f}  (after: base {f['after_base'][key]:.3f}, "
              f"adapter {f['after_adapter'][key]:.3f})")
    g = out["gap"]
    print(f"adapter logprob gap (PEFT vs vLLM LoRA, {g['tokens']} tokens): mean {g['mean']:.2e}, "
          f"p99 {g['p99']:.2e}, max {g['max']:.2e} nats (goal mean < {GAP_GOAL_NATS})")
    if args.json:
        args.json.write_text(json.dumps({**out, "gap_goal_nats": GAP_GOAL_NATS}, indent=2))


if __name__ == "__main__":
    main()
