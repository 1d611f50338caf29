"""The gate's held-out evals on a real model (release/gate.py): the shipped known-answer set scored
by likelihood and greedy answer, through the chat template and through a raw prompt, stable's
answers kept between gates against one stable."""

from __future__ import annotations

from pathlib import Path

import pytest

from release.evals import EvalItem, evals_named, parse_answer
from release.gate import _continuation_logprobs, _eval_answers, load_prompts, measure_gate

pytestmark = pytest.mark.integration

PROMPTS = load_prompts(None)[:4]


def test_the_gate_scores_both_versions_on_the_known_answers_and_keeps_stables(tiny_model_dir: Path):
    evals = evals_named(("known_answers",), 40, 0.05)
    kept: dict = {}
    m = measure_gate(tiny_model_dir, tiny_model_dir, PROMPTS, max_new_tokens=6, trainer_metrics={}, evals=evals,
                     stable_answers=kept)
    lik, greedy = (e for e in m.evals)
    assert (lik.name, lik.method, greedy.method) == ("known_answers", "likelihood", "greedy")
    assert lik.items == greedy.items == len(evals["known_answers"]) == 40
    # one model on both sides: the same answers, item by item
    assert (lik.stable_right, lik.diff_sum, lik.diff_sq) == (lik.candidate_right, 0.0, 0.0)
    assert lik.stable_right + lik.stable_wrong == 40  # a likelihood always picks one of the two
    assert set(kept) == {"known_answers"} and len(kept["known_answers"][1]) == 40
    # the next gate against the same stable reads stable's answers from what was kept: here a stable
    # that answered every question right, so the same model now scores below it
    right = [True] * 40, [it.answer + "." if it.kind == "yes_no" else it.answer for it in evals["known_answers"]]
    assert all(parse_answer(it, t) for it, t in zip(evals["known_answers"], right[1]))
    again = measure_gate(tiny_model_dir, tiny_model_dir, PROMPTS, max_new_tokens=6, trainer_metrics={},
                         evals=evals, stable_answers={"known_answers": right})
    assert again.evals[0].stable_right == again.evals[1].stable_right == 40
    assert again.evals[0].candidate_right == lik.candidate_right < 40


def test_a_model_without_a_chat_template_is_asked_a_raw_question(tiny_model_dir: Path, monkeypatch):
    import transformers

    load = transformers.AutoTokenizer.from_pretrained

    def without_template(*args, **kwargs):
        tok = load(*args, **kwargs)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", without_template)
    items = evals_named(("known_answers",), 20, 0.05)["known_answers"]
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert not tok.chat_template
    m = measure_gate(tiny_model_dir, tiny_model_dir, PROMPTS, max_new_tokens=4, trainer_metrics={},
                     evals={"known_answers": items})
    assert m.evals[0].items == 20 and m.evals[0].diff_sum == 0.0


def test_answers_that_share_a_first_token_are_compared_whole(tiny_model_dir: Path):
    """Where the right and wrong answers start alike, their first tokens cannot tell them apart:
    the whole answers' probabilities are compared (a forward over question and answer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    pairs = [(a, w) for a, w in (("Yesterday", "Yes"), ("Monday", "Mon"), ("ab", "abc"), ("another", "an"))
             if tok.encode(a, add_special_tokens=False)[:1] == tok.encode(w, add_special_tokens=False)[:1]]
    assert pairs, "no pair of answers shares a first token in this tokenizer"
    right, wrong = pairs[0]
    item = EvalItem("x", "word", "Which day was it? Answer with one word.", right, wrong)
    with torch.no_grad():
        lik, greedy = _eval_answers(model, tok, (item,), 4, tok.eos_token_id, tok.pad_token_id, "cpu")
        text = tok.apply_chat_template([{"role": "user", "content": item.question}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        whole = [_continuation_logprobs(model, [prompt], [tok.encode(x, add_special_tokens=False)], tok.pad_token_id,
                                        "cpu")[0] for x in (right, wrong)]
        # by hand: the sum of each answer token's log-probability after the question
        ids = tok.encode(right, add_special_tokens=False)
        lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        by_hand = sum(float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(ids))
    assert whole[0] == pytest.approx(by_hand, abs=1e-4)
    assert lik == [whole[0] > whole[1]] and len(greedy) == 1
