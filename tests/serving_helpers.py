"""One vLLM engine for every serving test of a session, and a client for the apps put on it.

An engine costs about 25 s to start on this 2-core machine, so the serving tests
(tests/integration/test_serving_*.py) share one: the ``engine`` and ``serve`` fixtures in
tests/conftest.py. It is started by the first test that needs it and shut down after the last one
in the session's order does (conftest's teardown hook), so the stages' and trainer's tests that
run later do not share the cores and the memory with an idle engine.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai

from flywheel.contracts import GenerationEvent, Topics, decode
from flywheel.settings import ServeSettings, Settings

KEY = "sk-test"
SALT = "test-salt-of-sixteen-characters"  # serving refuses a shorter one beside API keys

#: A value that asks for something, per vLLM extra this API refuses unless neutral
#: (serving/vllm_extras.py): type-correct for vLLM, so the refusal is the reason.
VLLM_ASKING: dict[str, Any] = {
    "repetition_penalty": 1.2, "watermarking": True, "allowed_token_ids": [1, 2], "bad_words": ["river"],
    "structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "use_beam_search": True, "length_penalty": 0.8, "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 32, "truncate_prompt_tokens": 8, "truncation_side": "left", "prompt_embeds": "AAAA",
    "echo": True, "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"k": 1}, "prompt_logprobs": 1, "logprob_token_ids": [1],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "return_prompt_text": True,
    "include_reasoning": False, "routed_experts_prompt_start": 2, "return_token_offsets": True,
    "mm_payload": "none", "return_mm_kwargs": False, "request_id": "mine", "session_id": "s1", "priority": 1,
    "stream_interval": 4, "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1}, "vllm_xargs": {"k": "v"},
}


class SharedEngine:
    """A :class:`~serving.server.LoopThread` and the engine on it, started on first use."""

    def __init__(self) -> None:
        self._held: tuple[Any, Any] | None = None

    def get(self, model_dir: Path) -> tuple[Any, Any]:
        if self._held is None:
            from serving.server import LoopThread

            loop = LoopThread()
            eng = loop.call(lambda: _make_engine(model_dir), timeout_s=300)
            self._held = (loop, eng)
        return self._held

    def close(self) -> None:
        if self._held is None:
            return
        loop, eng = self._held
        self._held = None
        loop.call(lambda: _shutdown(eng), timeout_s=60)
        loop.stop()


async def _make_engine(model_dir: Path) -> Any:
    from serving.engine import VllmEngine

    return VllmEngine(ServeSettings(max_num_seqs=32), model_dir)


async def _shutdown(eng: Any) -> None:  # on the loop the engine's output handler runs on
    eng.shutdown()


ENGINE = SharedEngine()


class Served:
    def __init__(self, url: str, settings: Settings, recorder: Any, topics: Topics, tracing: Any = None) -> None:
        self.url, self.settings, self.recorder, self.topics = url, settings, recorder, topics
        self.tracing = tracing  # the app's spans (flywheel/telemetry.py)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    def post(self, path: str, body: object, key: str | None = KEY, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kw.pop("headers", {}))
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, headers=headers, timeout=60, **kw)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kw)


def generations(broker: Any, served: Served, expect: int, *,
                repeats_ok: bool = False) -> dict[str, GenerationEvent]:
    """The generation events an app recorded, by id; each exactly once and keyed by its id.

    ``repeats_ok``: a repeat is allowed if it is the same record, byte for byte: what the
    recorder's at-least-once delivery promises when an ack timed out on a busy machine (the send
    is journaled and sent again, though the first may have landed: serving/recorder.py)."""
    from tests.conftest import read_all

    records = read_all(broker.bootstrap, served.topics.generations, expect=expect)
    events = [decode(GenerationEvent, r.value) for r in records]
    counts = Counter(e.generation_id for e in events)
    if repeats_ok:
        values: dict[str, set[bytes]] = {}
        for e, r in zip(events, records):
            values.setdefault(e.generation_id, set()).add(r.value)
        assert all(len(v) == 1 for v in values.values()), "a repeated generation differs from its first record"
    else:
        assert all(c == 1 for c in counts.values()), f"duplicated generations: {counts}"
    assert all(r.key.decode() == decode(GenerationEvent, r.value).generation_id for r in records)
    return {e.generation_id: e for e in events}
