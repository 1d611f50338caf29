"""OpenAI compatibility as a client sees it: logprobs in OpenAI's shapes (plain and streamed, the
sampled token's logprob the very one recorded for training), every parameter the API does not
implement refused by name, and the published OpenAPI schema.

Runs on the session's shared engine (tests/conftest.py), through the official openai client
where it can, as a product would.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from serving_helpers import VLLM_ASKING, Served, generations

from serving.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatRequest,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)

pytestmark = pytest.mark.integration

PROMPT = "the river runs"
MESSAGES = [{"role": "user", "content": "tell me about the river"}]


def _is_top(alternatives: list[float], n: int) -> None:
    assert len(alternatives) == n
    assert alternatives == sorted(alternatives, reverse=True)  # most likely first


def check_completion(lp, n: int) -> list[float]:
    """One choice's legacy logprobs (or one chunk's share): consistent lists, top-n (plus the
    sampled token) per token."""
    k = len(lp.tokens)
    assert k > 0 and len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == k
    for tok, sampled, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == sampled  # the sampled token is always among them
        assert len(top) in (n, n + 1)
        best = sorted(top.values(), reverse=True)[:n]
        assert sampled <= best[0] <= 0.0
    return list(lp.token_logprobs)


def check_chat(content, text: str, n: int, streamed: bool = False) -> list[float]:
    assert content
    for entry in content:
        _is_top([a.logprob for a in entry.top_logprobs], n)
        assert entry.logprob <= entry.top_logprobs[0].logprob if n else entry.logprob <= 0.0
        same = [a for a in entry.top_logprobs if a.token == entry.token]
        assert all(a.logprob == entry.logprob for a in same)
    # the bytes of the tokens, in order, are the text (special tokens have none and no text); a
    # stream never sends the text of bytes left over at its end that are no whole character
    joined = b"".join(bytes(e.bytes) for e in content if e.bytes is not None).decode("utf-8", "replace")
    if streamed:
        joined, text = joined.rstrip("\ufffd"), text.rstrip("\ufffd")
    assert joined == text
    return [e.logprob for e in content]


def test_completion_logprobs_plain_and_streamed_are_the_recorded_ones(serve, broker):
    s = serve()
    r = s.client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=8, logprobs=3, n=2, seed=3)
    CompletionResponse.model_validate(r.model_dump())
    shown = {c.generation_id: check_completion(c.logprobs, 3) for c in r.choices}
    for c in r.choices:  # where each token starts in the text
        assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(c.logprobs.text_offset)
        assert c.logprobs.text_offset[-1] <= len(c.text)
    assert sum(len(v) for v in shown.values()) == r.usage.completion_tokens

    parts: dict[str, list] = {}
    for chunk in s.client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=8, logprobs=2,
                                             stream=True):
        CompletionChunk.model_validate(chunk.model_dump())
        for c in chunk.choices:
            parts.setdefault(c.generation_id, []).append(c)
    (gid, chunks), = parts.items()
    lps = [x for c in chunks for x in c.logprobs.token_logprobs]
    offsets = [x for c in chunks for x in c.logprobs.text_offset]
    # one running count across chunks (a stream may hold back the text of bytes that are not yet
    # whole characters, so offsets are not checked against the streamed text's length)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for c in chunks:
        check_completion(c.logprobs, 2)
    shown[gid] = lps

    events = generations(broker, s, expect=3)
    assert {g: list(events[g].logprobs) for g in shown} == shown


def test_chat_logprobs_plain_and_streamed_are_the_recorded_ones(serve, broker):
    s = serve()
    r = s.client.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=8,
                                         logprobs=True, top_logprobs=5)
    ChatCompletionResponse.model_validate(r.model_dump())
    shown = {r.id: check_chat(r.choices[0].logprobs.content, r.choices[0].message.content, 5)}

    bare = s.client.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=4, logprobs=True)
    shown[bare.id] = check_chat(bare.choices[0].logprobs.content, bare.choices[0].message.content, 0)

    content, text, gid = [], [], None
    for chunk in s.client.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=8,
                                                  logprobs=True, top_logprobs=20, stream=True):
        ChatCompletionChunk.model_validate(chunk.model_dump())
        for c in chunk.choices:
            gid = c.generation_id
            content += c.logprobs.content
            text.append(c.delta.content)
    shown[gid] = check_chat(content, "".join(text), 20, streamed=True)

    events = generations(broker, s, expect=3)
    assert {g: list(events[g].logprobs) for g in shown} == shown


def test_without_logprobs_the_response_has_none(serve):
    s = serve()
    assert s.client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=2).choices[0].logprobs is None
    chat = s.client.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=2, logprobs=False)
    assert chat.choices[0].logprobs is None


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_ASKING = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"17": 5}, "echo": True,
           "suffix": "end", "response_format": {"type": "json_object"},
           "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
           "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "auto",
           "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
           "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
           "web_search_options": {}, "service_tier": "flex", "store": True, "metadata": {"k": "v"},
           "prompt_cache_key": "k", "prompt_cache_retention": "24h", **VLLM_ASKING}
REFUSED = (
    [(COMPLETIONS, name, _ASKING[name]) for name in CompletionRequest.UNSUPPORTED]
    + [(CHAT, name, _ASKING[name]) for name in ChatRequest.UNSUPPORTED]
    + [(COMPLETIONS, "best_of", 3), (COMPLETIONS, "logprobs", 6), (CHAT, "top_logprobs", 21),
       (COMPLETIONS, "mirostat_tau", 5.0), (CHAT, "n_probs", 2),  # other servers' names: not this API's
       (COMPLETIONS, "stream_options.include_obfuscation", True), (CHAT, "messages.0.name", "ann")]
)


def _body(path: str, name: str, value) -> dict:
    body = ({"model": "flywheel", "prompt": "x", "max_tokens": 1} if path == COMPLETIONS
            else {"model": "flywheel", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    if name == "top_logprobs":
        body["logprobs"] = True
    if name.startswith("stream_options."):
        body.update(stream=True, stream_options={name.split(".")[1]: value})
    elif name.startswith("messages."):
        body["messages"][0]["name"] = value
    else:
        body[name] = value
    return body


def test_each_unsupported_parameter_gets_a_400_that_names_it(serve):
    s = serve()
    wrong = []
    for path, name, value in REFUSED:
        r = s.post(path, _body(path, name, value))
        err = r.json().get("error", {})
        if not (r.status_code == 400 and err.get("param") == name and name in err.get("message", "")
                and err.get("type") == "invalid_request_error"):
            wrong.append((path, name, r.status_code, r.text))
    assert not wrong, wrong
    assert len(REFUSED) > 30


def test_default_values_of_unsupported_parameters_are_accepted(serve):
    """What OpenAI clients send when a feature is not used must not break them."""
    s = serve()
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "n": 1}
    r = s.post(COMPLETIONS, {**_body(COMPLETIONS, "echo", False), **neutral, "best_of": 1, "suffix": None})
    assert r.status_code == 200, r.text
    r = s.post(CHAT, {**_body(CHAT, "tools", []), **neutral, "tool_choice": "none", "store": False,
                      "response_format": {"type": "text"}, "service_tier": "auto", "modalities": ["text"],
                      "metadata": {}, "parallel_tool_calls": None, "max_completion_tokens": 2,
                      "stream_options": None, "safety_identifier": "user-1"})
    assert r.status_code == 200, r.text


def test_openapi_schema_is_published_and_valid(serve):
    s: Served = serve(max_tokens_limit=64, max_n=4)
    r = httpx.get(s.url + "/openapi.json")  # no key needed, as for /health
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    raw = r.json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    ops = [op.ok() for op in schema.get_all_operations()]  # every operation resolves
    assert {op.label for op in ops} == {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                        "POST /v1/feedback", "GET /health", "GET /livez", "GET /readyz",
                                        "GET /metrics"}
    assert raw["openapi"].startswith("3.")
    assert raw["components"]["securitySchemes"]["bearerAuth"] == {**raw["components"]["securitySchemes"]["bearerAuth"],
                                                                  "type": "http", "scheme": "bearer"}
    assert raw["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in raw["paths"]["/health"]["get"]
    body = raw["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatRequest"}
    chat = raw["components"]["schemas"]["ChatRequest"]
    assert chat["additionalProperties"] is False and chat["properties"]["tools"]["enum"] == [None, []]
    assert chat["properties"]["n"]["maximum"] == 4  # this deployment's limits
    assert {"type": "integer", "minimum": 1, "maximum": 64}.items() <= chat["properties"]["max_tokens"]["anyOf"][0].items()
    assert "text/event-stream" in raw["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert httpx.get(s.url + "/docs").status_code == 404  # no docs page
