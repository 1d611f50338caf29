"""Logprobs in OpenAI's shapes: which alternatives vLLM's per-step dict holds, token bytes of a
byte-level BPE tokenizer, and text offsets that run on across the chunks of a stream."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from serving.engine import _top
from serving.logprobs import UNSAMPLEABLE, LogprobsFormat, Pieces


@dataclass
class Lp:  # vLLM's Logprob: the fields read
    logprob: float
    rank: int


@pytest.mark.parametrize(
    "step, n, expected",
    [
        # sampled token 9 (rank 7) first, then the top 3: it is left out
        ({9: Lp(-4.0, 7), 1: Lp(-0.5, 1), 2: Lp(-1.0, 2), 3: Lp(-2.0, 3)}, 3, [(1, -0.5), (2, -1.0), (3, -2.0)]),
        # sampled token among the top 3: one key, three entries, its rank from the top list
        ({2: Lp(-1.0, 2), 1: Lp(-0.5, 1), 3: Lp(-2.0, 3)}, 3, [(1, -0.5), (2, -1.0), (3, -2.0)]),
        # a tie gives the sampled token (not in the top list) rank 1: still not one of the top n
        ({9: Lp(-0.5, 1), 1: Lp(-0.5, 1), 2: Lp(-1.0, 2)}, 2, [(1, -0.5), (2, -1.0)]),
        ({9: Lp(-4.0, 7)}, 0, []),
    ],
)
def test_top_n_from_a_vllm_step(step, n, expected):
    assert _top(step, n) == expected


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE over the 256 byte symbols plus one merge, and an EOS special token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}}
    vocab["Ġhi"] = len(vocab)
    vocab["Ġh"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "h"), ("Ġh", "i")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def test_pieces_are_the_tokens_bytes(tok):
    pieces = Pieces(tok)
    ids = tok.encode(" hi é", add_special_tokens=False)  # é is two bytes, two tokens
    assert [pieces[t].text for t in ids] == [" hi", " ", "bytes:\\xc3", "bytes:\\xa9"]
    assert b"".join(pieces[t].raw for t in ids).decode() == " hi é"
    eos = pieces[tok.eos_token_id]
    assert eos.text == "<eos>" and eos.raw is None  # special: not part of the text


def test_chat_shape(tok):
    ids = [*tok.encode(" hi", add_special_tokens=False), tok.eos_token_id]
    fmt = LogprobsFormat(Pieces(tok), chat=True)
    out = fmt.of(ids, [-0.25, -1.5], [[(ids[0], -0.25), (ids[1], -0.5)], [(ids[0], -math.inf), (ids[1], -1.5)]])
    assert out["refusal"] is None
    first, end = out["content"]
    assert first == {"token": " hi", "logprob": -0.25, "bytes": list(b" hi"), "top_logprobs": [
        {"token": " hi", "logprob": -0.25, "bytes": list(b" hi")},
        {"token": "<eos>", "logprob": -0.5, "bytes": None}]}
    assert end["bytes"] is None and end["top_logprobs"][0]["logprob"] == UNSAMPLEABLE
    json.dumps(out, allow_nan=False)  # valid JSON: no infinity left


def test_completion_offsets_run_on_across_chunks(tok):
    pieces = Pieces(tok)
    ids = tok.encode(" hi é!", add_special_tokens=False)
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    whole = LogprobsFormat(pieces, chat=False).of(ids, lps, [])
    assert whole["tokens"] == [" hi", " ", "bytes:\\xc3", "bytes:\\xa9", "!"]
    # " hi" 0, " " 3, é starts at 4 and its second byte adds no new start, "!" after é at 5
    assert whole["text_offset"] == [0, 3, 4, 4, 5]
    assert whole["token_logprobs"] == lps
    # no alternatives asked (logprobs=0): the sampled token alone
    assert whole["top_logprobs"][0] == {" hi": -0.1}
    streamed = LogprobsFormat(pieces, chat=False)
    chunks = [streamed.of(ids[:3], lps[:3], []), streamed.of(ids[3:], lps[3:], [])]
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"]


def test_completion_top_logprobs_include_the_sampled_token(tok):
    ids = tok.encode(" hi", add_special_tokens=False)
    other = tok.encode(" ", add_special_tokens=False)[0]
    out = LogprobsFormat(Pieces(tok), chat=False).of(ids, [-3.0], [[(other, -0.1)]])
    assert out["top_logprobs"] == [{" ": -0.1, " hi": -3.0}]  # OpenAI: up to logprobs + 1 entries
