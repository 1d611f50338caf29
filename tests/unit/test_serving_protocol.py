"""Request parsing: every bad body becomes a 400 that names the field."""

from __future__ import annotations

import json

import pytest

from serving.protocol import ApiError, ChatRequest, CompletionRequest, FeedbackRequest, parse


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


def test_good_bodies_parse_and_unknown_fields_are_ignored():
    c = parse(CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2], "stop": "x", "logit_bias": {}}).encode())
    assert c.prompt == [1, 2] and c.stops() == ("x",)
    chat = parse(ChatRequest, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode())
    assert chat.messages[0].text() == "ab"
    fb = parse(FeedbackRequest, json.dumps({"feedback_id": "f", "generation_id": "g", "signal": "edit",
                                            "edited_text": "better", "decision_ms": 1200}).encode())
    assert fb.decision_ms == 1200.0
    emoji = parse(FeedbackRequest, b'{"feedback_id": "f", "generation_id": "g", "signal": "edit", '
                                   b'"edited_text": "\\ud83d\\ude00"}')  # a pair is one character
    assert emoji.edited_text == "\U0001f600"
