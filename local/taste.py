"""How often the simulated users would accept a model's answers, sampled offline from a checkpoint.

    from local.taste import compare
    compare(Path("model"), Path("data/demo/checkpoints/v00000008"), users=200, seed=1)

A :class:`Sampler` loads a model directory with transformers (fp32, on the CPU), asks it the
prompts ``flywheel simulate`` asks (temperature 1, 24 tokens, as simulated users ask serving), and
has each answer judged by a random user of local/simulate.py's population, noise and missing
feedback included, the abusive user left out. :func:`compare` does that for two models with the
same draws: the same prompts, users, sampling noise and judging noise, batch for batch, so two
identical models get identical counts and a difference comes from the weights alone. Each batch
asks a different prompt (a seeded order through the prompt set), and the two models are compared
prompt by prompt (local/evidence.py's ``prompt_paired``): answers to one prompt are not
independent evidence, and a version that only moved prompts about, better on some and worse on
others, must not read as having learned.

``flywheel demo`` compares its newest version with the starting model this way once traffic
ends: a short run has too little live traffic on any one version to show learning beyond noise
(45 s gives a canary about 60 judgements), while a thousand answers sampled here take seconds.
bench/bare_loop.py samples its training batches with the same :class:`Sampler`.

A version may be full weights or a LoRA adapter (docs/trainer.md, "LoRA"): given the base
directory, an adapter is applied on it after the base is verified against the hash the adapter
names (flywheel/adapters.py), as the release gate does. :func:`greedy_answers` writes what a
version answers a few fixed prompts, greedily: the readable before and after of the demo's report
on a real model.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from local.evidence import prompt_paired
from local.simulate import TASTES, judge, population, taste_prompts

#: (accepts, judgements).
Counts = tuple[int, int]


class Sampler:
    """One model and the simulated users who judge its answers."""

    def __init__(self, model_dir: Path, *, seed: int, users: int = 40, gameable: bool = False, taste: str = "built",
                 base: Path | None = None, max_tokens: int = 24) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.tok, self.model = load(model_dir, base)
        self.users = population(users, TASTES[taste].cohorts, seed, gameable=gameable, abuser=False)
        self.prompts = taste_prompts(TASTES[taste])
        self.max_tokens = max_tokens
        self.batches = 0

    def sample(self, n: int, prompt: str | None = None) -> tuple[Any, int, list[str | None]]:
        """``n`` answers to one prompt (``prompt``, else one drawn from the taste's): token ids
        (prompt and answer), the prompt's length, and each answer's judgement (None: no feedback).
        The sampling noise of batch ``i`` is seeded by the seed and ``i``, so another Sampler of the
        same seed, asked the same, draws the same."""
        import torch

        prompt = prompt if prompt is not None else self.rng.choice(self.prompts)
        ids = self.tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        torch.manual_seed(self.seed * 1_000_003 + self.batches)
        self.batches += 1
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=self.max_tokens,
                                      num_return_sequences=n, pad_token_id=self.tok.pad_token_id)
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in out[:, ids.shape[1]:]]
        # judge() draws the same number of random numbers whatever the text: the draws stay paired
        return out, ids.shape[1], [judge(self.rng.choice(self.users), t, self.rng, prompt) for t in texts]


def load(model_dir: Path, base: Path | None = None) -> tuple[Any, Any]:
    """A version's tokenizer and model (fp32, CPU): full weights as they are, an adapter applied on
    ``base`` (verified first) and merged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base is None:
        return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir,
                                                                                               dtype=torch.float32)
    from flywheel.adapters import load_causal_lm, model_home

    return AutoTokenizer.from_pretrained(model_home(model_dir, base)), load_causal_lm(model_dir, base)


def greedy_answers(model_dir: Path, prompts: list[str], *, base: Path | None = None, max_tokens: int = 32) -> list[str]:
    """The version's answer to each prompt through its chat template, greedily: what it most
    likely says, the same every time it is asked, so two versions' answers differ only by their
    weights."""
    import torch

    tok, model = load(model_dir, base)
    model.eval()
    out = []
    for prompt in prompts:  # one at a time: no padding to differ between versions
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def counts(signals: list[str | None]) -> Counts:
    return sum(s == "accept" for s in signals), sum(s is not None for s in signals)


def compare(start: Path, newest: Path, *, users: int, seed: int, gameable: bool = False, samples: int = 1024,
            batch: int = 64, budget_s: float = 30.0, taste: str = "built", base: Path | None = None,
            max_tokens: int = 24) -> dict[str, Any]:
    """The two models' answers, drawn alike, batch by batch in turn until ``samples`` each or
    ``budget_s`` (a large model gets fewer: its z says how much evidence that was), each batch a
    prompt of a seeded order through the taste's prompts (all of them before any is asked again).
    ``start`` and ``newest``: the pooled counts; ``by_prompt``: each prompt's (start, newest)
    counts; ``z``: the paired-by-prompt comparison (local/evidence.py), with ``prompts``, ``t``
    and ``mean_lift``."""
    import torch

    torch.set_num_threads(1)  # the loop's processes may still be stopping beside it
    a, b = (Sampler(d, seed=seed, users=users, gameable=gameable, taste=taste, base=base, max_tokens=max_tokens)
            for d in (start, newest))
    order = random.Random(seed).sample(a.prompts, len(a.prompts))
    by_prompt: dict[str, tuple[Counts, Counts]] = {}
    deadline = time.monotonic() + budget_s
    while a.batches * batch < samples and time.monotonic() < deadline:
        prompt = order[a.batches % len(order)]
        was = by_prompt.get(prompt, ((0, 0), (0, 0)))
        now = counts(a.sample(batch, prompt)[2]), counts(b.sample(batch, prompt)[2])
        by_prompt[prompt] = tuple(tuple(map(sum, zip(x, y))) for x, y in zip(was, now))
    pairs = list(by_prompt.values())
    pooled = [[sum(c[side][i] for c in pairs) for i in (0, 1)] for side in (0, 1)]
    paired = prompt_paired(pairs)
    return {"start": pooled[0], "newest": pooled[1], "z": paired.z, "t": paired.t, "prompts": paired.prompts,
            "mean_lift": paired.mean_lift,
            "by_prompt": [[p, list(s), list(n)] for p, (s, n) in by_prompt.items()]}
