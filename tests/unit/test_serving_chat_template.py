"""A model imported without a chat template (a base model: `flywheel model import` warns) answers
chat requests with a 400 that says what to do instead, never a 500; with one, the model's own
template writes the prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flywheel.modelinit import CHAT_TEMPLATE, build_tokenizer
from flywheel.settings import ServeSettings
from serving.generate import prepare_chat
from serving.protocol import ApiError, ChatRequest


def test_a_model_without_a_chat_template_refuses_chat_with_a_400_naming_the_way_out():
    tok = build_tokenizer(512)
    ctx = SimpleNamespace(serve=ServeSettings(), fleet=SimpleNamespace(tokenizer=tok, max_model_len=512))
    body = ChatRequest(model="flywheel", messages=[{"role": "user", "content": "hello"}])
    tok.chat_template = None
    with pytest.raises(ApiError) as err:
        prepare_chat(ctx, body, "someone")
    assert err.value.status == 400 and err.value.param == "messages"
    assert "no chat template" in err.value.message and "/v1/completions" in err.value.message
    tok.chat_template = CHAT_TEMPLATE
    assert prepare_chat(ctx, body, "someone").prompt_text == "<|bos|><|user|>hello<|end|><|assistant|>"
