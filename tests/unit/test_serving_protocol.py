"""Request parsing: every bad body becomes a 400 that names the field; every OpenAI parameter the
API does not implement is refused by name unless it asks for nothing."""

from __future__ import annotations

import json

import pytest
from serving_helpers import VLLM_ASKING

from serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    StreamOptions,
    parse,
)


@pytest.mark.parametrize(
    "cls, body, param, words",
    [
        (CompletionRequest, b"{not json", None, "not valid JSON"),
        (CompletionRequest, b"[1, 2]", None, "JSON object"),
        (CompletionRequest, b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, "nested too deeply"),
        (CompletionRequest, {"model": "m"}, "prompt", "Field required"),
        (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
        (CompletionRequest, {"model": "m", "prompt": "x", "temperature": 3}, "temperature", "less than"),
        (CompletionRequest, {"model": "m", "prompt": "x", "n": 0}, "n", "greater than"),
        (ChatRequest, {"model": "m", "messages": []}, "messages", "at least 1"),
        (ChatRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "system"),
        (FeedbackRequest, {"feedback_id": "f", "generation_id": "g", "signal": "love"}, "signal", "accept"),
        (FeedbackRequest, {"feedback_id": "f", "generation_id": "g", "signal": "edit"}, None, "edited_text"),
        (FeedbackRequest, {"feedback_id": "f", "generation_id": "g", "signal": "accept", "extra": 1}, "extra", "not permitted"),
        (FeedbackRequest, {"feedback_id": "", "generation_id": "g", "signal": "accept"}, "feedback_id", "at least 1"),
        # json reads NaN and Infinity; a NaN time would never close its join window downstream
        (FeedbackRequest, {"feedback_id": "f", "generation_id": "g", "signal": "accept", "created_at": float("nan")},
         "created_at", "finite"),
        (FeedbackRequest, {"feedback_id": "f", "generation_id": "g", "signal": "accept", "decision_ms": float("inf")},
         "decision_ms", "finite"),
        (FeedbackRequest, b'{"feedback_id": "f", "generation_id": "g", "signal": "edit", "edited_text": "\\ud800"}',
         None, "lone UTF-16 surrogate"),
        (ChatRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi \\uDC00"}]}', None, "surrogate"),
        # names that are no parameter of this API: refused, never dropped
        (CompletionRequest, {"model": "m", "prompt": "x", "mirostat_tau": 5.0}, "mirostat_tau", "unknown parameter"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages.0.name",
         "unknown parameter"),
        (CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x", "unknown parameter"),
        # logprobs: OpenAI's bounds, and top_logprobs only with logprobs
        (CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        (CompletionRequest, {"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "integer"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "less than or equal to 20"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs", "needs logprobs: true"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", "boolean"),
        # other cross-field and range rules
        (CompletionRequest, {"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of", "equal to n"),
        (CompletionRequest, {"model": "m", "prompt": "x", "user": "a", "safety_identifier": "b"}, "safety_identifier",
         "same end user"),
        (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop", "empty"),
        (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (CompletionRequest, {"model": "m", "prompt": "x", "seed": 2**63}, "seed", "less than"),
        # found by the fuzz test: a top_k past 64 bits crashed the engine's request encoding (500)
        (CompletionRequest, {"model": "m", "prompt": "x", "top_k": 2**64}, "top_k", "less than"),
    ],
)
def test_bad_bodies_name_the_problem(cls, body, param, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as info:
        parse(cls, raw)
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert words in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_good_bodies_parse():
    c = parse(CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2], "stop": "x", "logit_bias": {}}).encode())
    assert c.prompt == [1, 2] and c.stops() == ("x",) and c.top_logprobs_n() is None
    chat = parse(ChatRequest, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode())
    assert chat.messages[0].text() == "ab"
    fb = parse(FeedbackRequest, json.dumps({"feedback_id": "f", "generation_id": "g", "signal": "edit",
                                            "edited_text": "better", "decision_ms": 1200}).encode())
    assert fb.decision_ms == 1200.0
    emoji = parse(FeedbackRequest, b'{"feedback_id": "f", "generation_id": "g", "signal": "edit", '
                                   b'"edited_text": "\\ud83d\\ude00"}')  # a pair is one character
    assert emoji.edited_text == "\U0001f600"


@pytest.mark.parametrize(
    "cls, body, top",
    [
        (CompletionRequest, {"logprobs": 0}, 0),
        (CompletionRequest, {"logprobs": 5}, 5),
        (ChatRequest, {"logprobs": True}, 0),
        (ChatRequest, {"logprobs": True, "top_logprobs": 20}, 20),
        (ChatRequest, {"logprobs": False}, None),
        (ChatRequest, {"logprobs": False, "top_logprobs": None}, None),
    ],
)
def test_logprobs_asked_for(cls, body, top):
    base = {"model": "m", "prompt": "x"} if cls is CompletionRequest else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse(cls, json.dumps({**base, **body}).encode()).top_logprobs_n() == top


def test_safety_identifier_is_the_end_user():
    body = {"model": "m", "prompt": "x", "safety_identifier": "ann"}
    assert parse(CompletionRequest, json.dumps(body).encode()).end_user() == "ann"
    assert parse(CompletionRequest, json.dumps({**body, "user": "ann"}).encode()).end_user() == "ann"


_BASES = {
    CompletionRequest: {"model": "m", "prompt": "x"},
    ChatRequest: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    StreamOptions: {},
}
# a value that asks for something, per parameter (type-correct, so the refusal is the reason)
_ASKING = {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"17": 5}, "echo": True, "suffix": "end",
           "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
           "tool_choice": "auto", "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "auto",
           "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
           "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
           "web_search_options": {}, "service_tier": "priority", "store": True, "metadata": {"k": "v"},
           "prompt_cache_key": "k", "prompt_cache_retention": "24h", "include_obfuscation": True, **VLLM_ASKING}


@pytest.mark.parametrize("cls, name", [(cls, name) for cls in _BASES for name in cls.UNSUPPORTED])
def test_every_unsupported_parameter_is_refused_by_name_unless_it_asks_for_nothing(cls, name):
    rule = cls.UNSUPPORTED[name]
    for value in rule.accepted:  # what clients send by default passes, and is not kept
        parsed = cls.model_validate({**_BASES[cls], name: value})
        assert name not in parsed.model_dump()
    with pytest.raises(ApiError) as info:
        cls.model_validate({**_BASES[cls], name: _ASKING[name]})
    param = f"{cls.PARAM_PREFIX}{name}"
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param} is not supported: ")


@pytest.mark.parametrize("value", [False, "0", [], 1e-9])
def test_a_neutral_value_must_be_the_same_kind(value):
    # False == 0 in Python, but a client sending presence_penalty: false has a bug worth seeing
    with pytest.raises(ApiError):
        CompletionRequest.model_validate({**_BASES[CompletionRequest], "presence_penalty": value})


def test_the_schema_lists_unsupported_parameters_with_the_values_accepted():
    props = ChatRequest.model_json_schema()["properties"]
    assert props["tools"]["enum"] == [None, []]
    assert props["service_tier"]["enum"] == [None, "auto", "default"]
    assert "not implemented" in props["tools"]["description"]
    assert ChatRequest.model_json_schema()["additionalProperties"] is False
