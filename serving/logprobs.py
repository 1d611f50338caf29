"""Logprobs in OpenAI's response shapes, from the engine's per-token ids and logprobs.

Completions (legacy)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{"tok": -0.1, ...}, ...],
     "text_offset": [...]}

Chat::

    {"content": [{"token": "tok", "logprob": -0.1, "bytes": [116, 111, 107],
                  "top_logprobs": [{"token": ..., "logprob": ..., "bytes": ...}, ...]}, ...],
     "refusal": null}

The logprobs are the engine's processed ones (see :mod:`serving.engine`): the sampled token's is
exactly the one recorded with the generation. A token that could not be sampled (cut by top-p /
top-k) has log p = -inf, which JSON cannot carry: it is reported as -9999.0, as OpenAI and vLLM
do. Streaming sends each delta's share; :class:`LogprobsFormat` keeps ``text_offset`` running
across the chunks of one choice.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Any

from serving.engine import TopLogprobs

UNSAMPLEABLE = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is written as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTES_OF = _byte_decoder()


@dataclass(frozen=True)
class Piece:
    text: str
    """The token as text; ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters
    (a multi-byte character split across tokens), as OpenAI writes such tokens."""
    raw: bytes | None
    """Its bytes in the completion text; None for special tokens, which the text leaves out."""


class Pieces:
    """Token id -> :class:`Piece`, cached per id (a vocabulary's worth at most).

    Exact bytes for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) and SentencePiece byte
    tokens; otherwise the token's decoded text, with SentencePiece's word marker as a space.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, Piece] = {}

    def __getitem__(self, tid: int) -> Piece:
        piece = self._cache.get(tid)
        if piece is None:
            piece = self._cache[tid] = self._make(tid)
        return piece

    def _make(self, tid: int) -> Piece:
        token = self._tok.convert_ids_to_tokens(tid)
        if tid in self._special or token is None:
            return Piece(token or "", None)
        raw = self._bytes(tid, token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return Piece(text, raw)

    def _bytes(self, tid: int, token: str) -> bytes:
        if self._byte_level and all(c in _BYTES_OF for c in token):
            return bytes(_BYTES_OF[c] for c in token)
        if m := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(m.group(1), 16)])
        if "▁" in token:
            return token.replace("▁", " ").encode()
        return self._tok.decode([tid]).encode()


def _lp(x: float) -> float:
    # -inf (and NaN, which max() would keep) -> a number JSON can carry
    return x if x >= UNSAMPLEABLE else UNSAMPLEABLE  # noqa: FURB136


class LogprobsFormat:
    """One choice's logprobs in its endpoint's shape, one delta at a time."""

    def __init__(self, pieces: Pieces, chat: bool) -> None:
        self.pieces, self.chat = pieces, chat
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def of(self, ids: list[int], lps: list[float], top: TopLogprobs) -> dict[str, Any]:
        """``top`` is empty when no alternatives were asked for (``top_logprobs`` 0)."""
        tops = top or [[] for _ in ids]
        return self._chat(ids, lps, tops) if self.chat else self._completion(ids, lps, tops)

    def _chat(self, ids: list[int], lps: list[float], tops: TopLogprobs) -> dict[str, Any]:
        content = []
        for tid, lp, alts in zip(ids, lps, tops):
            entry = self._entry(tid, lp)
            entry["top_logprobs"] = [self._entry(t, a) for t, a in alts]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _entry(self, tid: int, lp: float) -> dict[str, Any]:
        p = self.pieces[tid]
        return {"token": p.text, "logprob": _lp(lp), "bytes": None if p.raw is None else list(p.raw)}

    def _completion(self, ids: list[int], lps: list[float], tops: TopLogprobs) -> dict[str, Any]:
        tokens, offsets, top_logprobs = [], [], []
        for tid, lp, alts in zip(ids, lps, tops):
            p = self.pieces[tid]
            tokens.append(p.text)
            offsets.append(self._chars)
            if p.raw is not None:  # characters this token completes (a split one counts once)
                self._chars += len(self._utf8.decode(p.raw))
            alt = {self.pieces[t].text: _lp(a) for t, a in alts}
            alt.setdefault(p.text, _lp(lp))  # OpenAI: the sampled token is always among them
            top_logprobs.append(alt)
        return {"tokens": tokens, "token_logprobs": [_lp(x) for x in lps[:len(ids)]],
                "top_logprobs": top_logprobs, "text_offset": offsets}
