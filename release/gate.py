"""The offline gate: candidate against stable on held-out prompts, before any user sees it.

Which engine generates: Hugging Face transformers on the controller's own CPU (or GPU), loading
both versions from verified model directories (a LoRA version: its adapter applied on the base
model, ``model_dir``, once the base's hash is the one the adapter names: flywheel/adapters.py).
Not serving's vLLM engines: the gate must not take
capacity from users, nor depend on serving being up, and it needs the full next-token
distribution of both models on the same tokens (for KL and entropy), which a transformers forward
gives directly while vLLM returns only top-k logprobs. The held-out set is small (dozens of
prompts, a few dozen tokens each), so this costs seconds on the tiny model.

What it measures (:class:`release.judge.GateMeasurement`): mean output length of each, the
candidate's mean per-token KL from stable and both per-token entropies (exact, from the full
distributions, on the candidate's own samples), the share of distinct completions of each, the
mean score of each configured verifier and reward model (``release.gate_scorers``, from the
registry the reward stage uses: flywheel/scorers.py) for both, the trainer's collapse signals
from the checkpoint event, and a :class:`~flywheel.degeneracy.TextProfile` of each version's
decoded answers (character repetition, character classes, lengths), which the judge compares
whatever scorers are configured: a version that games its users with degenerate text fails the
gate by default. And what the answers say (a :class:`~release.meaning.MeaningProfile` of the
held-out prompts' answers: leading words, shared openings, relevance),
and each held-out eval (``release.evals``, release/evals.py) scored by both versions two ways:
the likelihood of each question's right answer against its wrong one, and the greedy answer
parsed. Judging is release/judge.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flywheel.degeneracy import TextProfile
from release.evals import EvalItem, continuation, parse_answer, prompt_text
from release.judge import EvalScore, GateMeasurement
from release.meaning import MeaningProfile

log = logging.getLogger(__name__)

#: The default held-out prompts, shipped with the package.
DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")


class GateError(RuntimeError):
    """The gate could not be measured (a version that does not load, an empty prompt set)."""


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from a JSON-lines file (``{"prompt": "..."}`` per line)."""
    path = path or DEFAULT_PROMPTS
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise GateError(f"{path}:{n}: not a JSON object with a prompt ({exc})") from None
    if not prompts:
        raise GateError(f"{path} holds no prompts")
    return prompts


#: A scorer as the gate calls it: (prompt, prompt tokens, completion, completion tokens) -> score or None.
Scorer = Callable[[str, list[int], str, list[int]], "float | None"]


def scorers_named(names: tuple[str, ...], reward_settings: Any) -> dict[str, Scorer]:
    """The configured verifiers and reward models (flywheel/scorers.py), as the gate calls them.
    An unknown name is a configuration error, raised at start."""
    from flywheel import scorers
    from flywheel.settings import SettingsError

    out: dict[str, Scorer] = {}
    for name in names:
        kind, _, arg = name.partition(":")
        if kind == "verifier" and arg in scorers.VERIFIERS:
            out[name] = _verifier_scorer(scorers.VERIFIERS[arg])
        elif kind == "reward_model" and arg in scorers.REWARD_MODELS:
            model = scorers.REWARD_MODELS[arg](reward_settings)
            out[name] = lambda p, _pt, c, _ct, model=model: model.score(p, c)
        else:
            raise SettingsError(f"release.gate_scorers: unknown scorer {name!r}; known: "
                                f"{', '.join(scorers.known()) or 'none (register them in release.plugins modules)'}")
    return out


def _verifier_scorer(fn: Any) -> Scorer:
    """A verifier takes an episode: the held-out answer as one, with no user signal."""
    from flywheel.contracts import EpisodeEvent, GenerationEvent, SamplingParams

    def score(prompt: str, prompt_ids: list[int], completion: str, completion_ids: list[int]) -> float | None:
        t = time.time()
        gen = GenerationEvent(
            generation_id="gate", group_id="gate", model_name="gate", model_version=0, user_id="gate",
            endpoint="completions", created_at=t, completed_at=t, latency_ms=0, prompt_text=prompt,
            prompt_token_ids=tuple(prompt_ids) or (0,), completion_text=completion,
            completion_token_ids=tuple(completion_ids), logprobs=tuple(0.0 for _ in completion_ids),
            sampling=SamplingParams(temperature=1, top_p=1, max_tokens=max(1, len(completion_ids))),
            finish_reason="stop")
        return fn(EpisodeEvent(generation=gen, signal="ignore", resolved_at=t))
    return score


def measure_gate(stable_dir: Path, candidate_dir: Path, prompts: list[str], *, max_new_tokens: int,
                 trainer_metrics: dict[str, float], seed: int = 0,
                 scorers: dict[str, Scorer] | None = None, base_dir: Path | None = None,
                 evals: dict[str, tuple[EvalItem, ...]] | None = None, eval_max_new_tokens: int = 8,
                 stable_answers: dict[str, tuple[list[bool], list[str]]] | None = None) -> GateMeasurement:
    """Sample each prompt from both models and compare them (module docstring). ``base_dir``: the
    base model that adapter versions apply to (needed only when one of them is an adapter).
    ``evals``: the held-out evals (release/evals.py), each item scored by both versions.
    ``stable_answers``: stable's scoring of each eval by name, kept by the caller between gates
    against one stable (greedy and likelihoods are the same each time: half of the evals' cost);
    filled in here when missing."""
    import torch
    from transformers import AutoTokenizer

    from flywheel.adapters import load_causal_lm, model_home

    # the controller's own accelerator when it has one, else its CPU; float32 either way, so
    # entropies and KL compare versions, not precisions
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = Path(base_dir) if base_dir is not None else Path(stable_dir)
    tok = AutoTokenizer.from_pretrained(str(model_home(stable_dir, base)))
    stable = load_causal_lm(stable_dir, base).to(device).eval()
    cand = load_causal_lm(candidate_dir, base).to(device).eval()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or 0)
    # every prompt at once, in one batch per model: prompt by prompt, the gate took ~30 s of a
    # busy two-core machine for 24 prompts, all of it between a checkpoint and its canary
    prompt_ids = [tok.encode(prompt) or [eos or 0] for prompt in prompts]
    with torch.no_grad():
        # common random numbers: both versions sample from the same random stream, so a candidate
        # that changed little answers much as stable did, and comparing their answers (the
        # degeneracy checks) measures the change rather than the luck of two draws. With a stream
        # each, the character repetition of one unchanged model moved by 0.03 (sd) over 8 prompts.
        torch.manual_seed(seed)
        s_seqs = _sample_all(stable, prompt_ids, max_new_tokens, eos, pad, device)
        torch.manual_seed(seed)
        c_seqs = _sample_all(cand, prompt_ids, max_new_tokens, eos, pad, device)
        s_ent = [x for ent, _ in _entropy_and_kl(stable, None, prompt_ids, s_seqs, pad, device) for x in ent]
        c_ent, kls = [], []
        for ent, kl in _entropy_and_kl(cand, stable, prompt_ids, c_seqs, pad, device):
            c_ent.extend(ent)
            kls.extend(kl)
        scores = []
        known = stable_answers if stable_answers is not None else {}
        for name, items in (evals or {}).items():
            if name not in known:
                known[name] = _eval_answers(stable, tok, items, eval_max_new_tokens, eos, pad, device)
            s_lik, s_greedy = known[name]
            c_lik, c_greedy = _eval_answers(cand, tok, items, eval_max_new_tokens, eos, pad, device)
            scores.append(EvalScore.of(name, "likelihood", s_lik, c_lik))
            scores.append(EvalScore.of(name, "greedy", [parse_answer(it, t) for it, t in zip(items, s_greedy)],
                                       [parse_answer(it, t) for it, t in zip(items, c_greedy)]))
    answers = list(zip(prompts, prompt_ids, s_seqs, c_seqs))
    s_texts = [tok.decode(x, skip_special_tokens=True) for x in s_seqs]
    c_texts = [tok.decode(x, skip_special_tokens=True) for x in c_seqs]
    s_len, c_len = [len(x) for x in s_seqs], [len(x) for x in c_seqs]
    s_outs, c_outs = {tuple(x) for x in s_seqs}, {tuple(x) for x in c_seqs}
    n = len(prompts)
    return GateMeasurement(
        prompts=n,
        stable_length_mean=sum(s_len) / n, candidate_length_mean=sum(c_len) / n,
        kl_from_stable=sum(kls) / len(kls) if kls else 0.0,
        stable_entropy=sum(s_ent) / len(s_ent) if s_ent else 0.0,
        candidate_entropy=sum(c_ent) / len(c_ent) if c_ent else 0.0,
        stable_distinct=len(s_outs) / n, candidate_distinct=len(c_outs) / n,
        scores=_scores(scorers or {}, answers, tok.decode),
        trainer_metrics=dict(trainer_metrics),
        # the text users would read: serving's answers leave special tokens out too
        stable_text=TextProfile.of(s_texts), candidate_text=TextProfile.of(c_texts),
        # what the answers say, on the samples users would read; not the evals' greedy answers: a
        # small model's greedy text falls into loops ("99999999"), and which loop moved with
        # every honest version of the built demo (its leading-word share 19% -> 93%)
        stable_meaning=MeaningProfile.of(list(zip(prompts, s_texts))),
        candidate_meaning=MeaningProfile.of(list(zip(prompts, c_texts))),
        evals=tuple(scores),
    )


#: Sequences per forward pass of the evals' whole-answer scoring (a batch's logits are batch x
#: length x vocab floats: 16 x 60 x 49k, 190 MB for SmolLM2); the greedy answers take four times
#: as many a batch, their logits kept for the first token only.
EVAL_BATCH = 16


def _eval_answers(model: Any, tok: Any, items: tuple[EvalItem, ...], max_new: int, eos: int | None, pad: int,
                  device: str) -> tuple[list[bool], list[str]]:
    """For each item: whether the model gives its right answer a higher probability than its wrong
    one, and its greedy answer (release/evals.py). Through the chat template where the tokenizer
    has one, as users ask; else a raw "Question: ... Answer:" prompt. Where the two answers start
    with different tokens ("Yes" and "No", "Tokyo" and "Kyoto"), their first tokens' probabilities
    are compared, read off the greedy answer's first step: one pass over the prompts serves both
    ways of scoring (whole answers, 84 more passes of two-token words, took SmolLM2 18 s more per
    version on two cores). Answers that share a first token are compared whole."""
    import torch

    chat = bool(getattr(tok, "chat_template", None))
    prompt_ids = []
    for it in items:
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": it.question}], tokenize=False,
                                           add_generation_prompt=True)
            prompt_ids.append(tok.encode(text, add_special_tokens=False) or [eos or 0])
        else:
            prompt_ids.append(tok.encode(prompt_text(it.question, chat)) or [eos or 0])
    greedy: list[list[int]] = []
    first: list[Any] = []
    for i in range(0, len(prompt_ids), EVAL_BATCH * 4):
        seqs, logits = _generate(model, prompt_ids[i:i + EVAL_BATCH * 4], max_new, eos, pad, device, sample=False,
                                 first_logits=True)
        greedy.extend(seqs)
        first.extend(torch.log_softmax(logits.float(), -1))
    right = [tok.encode(continuation(it.answer, chat), add_special_tokens=False) for it in items]
    wrong = [tok.encode(continuation(it.wrong, chat), add_special_tokens=False) for it in items]
    longer = [i for i in range(len(items)) if right[i][:1] == wrong[i][:1]]
    lp_right = {i: float(first[i][right[i][0]]) for i in range(len(items)) if i not in longer}
    lp_wrong = {i: float(first[i][wrong[i][0]]) for i in range(len(items)) if i not in longer}
    lp_right.update(zip(longer, _continuation_logprobs(model, [prompt_ids[i] for i in longer],
                                                       [right[i] for i in longer], pad, device)))
    lp_wrong.update(zip(longer, _continuation_logprobs(model, [prompt_ids[i] for i in longer],
                                                       [wrong[i] for i in longer], pad, device)))
    return ([lp_right[i] > lp_wrong[i] for i in range(len(items))],
            [tok.decode(x, skip_special_tokens=True) for x in greedy])


def _continuation_logprobs(model: Any, prompt_ids: list[list[int]], conts: list[list[int]], pad: int,
                           device: str) -> list[float]:
    """log P(continuation | prompt) under ``model``, summed over its tokens, for each pair."""
    import torch

    out = []
    for i in range(0, len(prompt_ids), EVAL_BATCH):
        ps, cs = prompt_ids[i:i + EVAL_BATCH], conts[i:i + EVAL_BATCH]
        ids, mask = _right_padded([p + c for p, c in zip(ps, cs)], pad, device)
        logits = model(ids, attention_mask=mask).logits.float()
        for j, (p, c) in enumerate(zip(ps, cs)):
            rows = logits[j, len(p) - 1:len(p) - 1 + len(c)]  # the distributions that chose each token
            lp = torch.log_softmax(rows, -1).gather(1, torch.tensor(c, device=rows.device)[:, None])
            out.append(float(lp.sum()))
    return out


def _scores(scorers: dict[str, Scorer], answers: list[tuple[str, list[int], list[int], list[int]]],
            decode: Callable[[list[int]], str]) -> dict[str, tuple[float, float]]:
    """Each scorer's mean over the prompts it scored for both versions: (stable, candidate)."""
    out: dict[str, tuple[float, float]] = {}
    for name, score in scorers.items():
        pairs = []
        for prompt, prompt_ids, s_seq, c_seq in answers:
            s_val = score(prompt, prompt_ids, decode(s_seq), s_seq)
            c_val = score(prompt, prompt_ids, decode(c_seq), c_seq)
            if s_val is not None and c_val is not None:
                pairs.append((float(s_val), float(c_val)))
        if pairs:
            out[name] = (sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs))
    return out


def _sample_all(model: Any, prompt_ids: list[list[int]], max_new: int, eos: int | None, pad: int,
                device: str) -> list[list[int]]:
    """Up to ``max_new`` tokens for each prompt, sampled at temperature 1 (with the KV cache) in one
    left-padded batch; each without its prompt and its end-of-sequence token."""
    return _generate(model, prompt_ids, max_new, eos, pad, device, sample=True)


def _generate(model: Any, prompt_ids: list[list[int]], max_new: int, eos: int | None, pad: int, device: str, *,
              sample: bool, first_logits: bool = False) -> Any:
    """Up to ``max_new`` tokens for each prompt, sampled at temperature 1 or greedy, in one
    left-padded batch; each without its prompt and its end-of-sequence token. With
    ``first_logits``: (those, the logits of each prompt's next token, batch x vocab)."""
    import torch

    width = max(len(ids) for ids in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    res = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, eos_token_id=eos,
                         pad_token_id=pad, return_dict_in_generate=True, output_logits=first_logits, **how)
    out = res.sequences
    seqs = []
    for row in out[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos)]
        elif pad != eos:
            while row and row[-1] == pad:  # (a batch runs on until its longest answer ends)
                row.pop()
        seqs.append(row)
    return (seqs, res.logits[0]) if first_logits else seqs


def _right_padded(seqs: list[list[int]], pad: int, device: str) -> tuple[Any, Any]:
    """Token ids and attention mask of sequences in one batch, padded on the right."""
    import torch

    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return ids.to(device), mask.to(device)


def _entropy_and_kl(p_model: Any, q_model: Any | None, prompt_ids: list[list[int]], completions: list[list[int]],
                    pad: int, device: str) -> list[tuple[list[float], list[float]]]:
    """For each prompt and its completion, at each completion position: the entropy of
    ``p_model``'s next-token distribution and, with ``q_model``, KL(p || q). One right-padded
    forward of each model over the batch (positions past a sequence's end are never read)."""
    import torch

    ids, mask = _right_padded([p + c for p, c in zip(prompt_ids, completions)], pad, device)
    lp = torch.log_softmax(p_model(ids, attention_mask=mask).logits.float(), -1)
    lq = torch.log_softmax(q_model(ids, attention_mask=mask).logits.float(), -1) if q_model is not None else None
    out = []
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        if not c:
            out.append(([], []))
            continue
        rows = slice(len(p) - 1, len(p) - 1 + len(c))  # the distributions that chose each completion token
        lpi = lp[i, rows]
        entropy = [float(x) for x in -(lpi.exp() * lpi).sum(-1)]
        kl = [] if lq is None else [float(x) for x in (lpi.exp() * (lpi - lq[i, rows])).sum(-1)]
        out.append((entropy, kl))
    return out


def gate_record(measurement: GateMeasurement) -> dict[str, Any]:
    record = asdict(measurement)
    for side in ("stable_meaning", "candidate_meaning"):
        record[side]["seen"], record[side]["novel"] = [], ""  # the gate compares distinct completions itself
    return record
