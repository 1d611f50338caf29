"""vLLM's extra request parameters, held to their one table (serving/vllm_extras.py).

vLLM's own request models are the reference, read from the installed vllm: every field of its
completions and chat requests must be a parameter of this API or refused by name, and vLLM's
default for each (what its clients send when they use no feature) must be accepted. Each row of
the table is then checked for what it says: neutral values accepted and dropped, any other value
of a refused parameter a 400 that names it, and an implemented sampling parameter carried all the
way to vLLM's ``SamplingParams`` and to the recorded generation (whose old records still decode,
and whose neutral values are written exactly as before the fields existed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_helpers import VLLM_ASKING

from flywheel.contracts import GenerationEvent, SamplingParams, decode, encode
from serving.engine import vllm_params
from serving.generate import COMPLETION_DEFAULT_MAX_TOKENS, gen_request, sampling_record
from serving.protocol import ApiError, ChatRequest, CompletionRequest, parse
from serving.vllm_extras import VLLM_EXTRAS, Implemented, Unsupported

OURS = {"completions": CompletionRequest, "chat": ChatRequest}
BASES = {"completions": {"model": "m", "prompt": "x"},
         "chat": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}
#: A value that asks for something, per implemented parameter.
DOING = {"top_k": 5, "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [5, 7], "ignore_eos": True,
         "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
         "add_special_tokens": False, "add_generation_prompt": False, "continue_final_message": True}
REFUSED = [(ep, name) for name, e in VLLM_EXTRAS.items() if isinstance(e.rule, Unsupported) for ep in e.endpoints]
IMPLEMENTED = [(ep, name) for name, e in VLLM_EXTRAS.items() if isinstance(e.rule, Implemented) for ep in e.endpoints]


@pytest.fixture(scope="module")
def vllm_requests():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VllmCompletionRequest,
    )

    return {"completions": VllmCompletionRequest, "chat": ChatCompletionRequest}


def _vllm_defaults(model) -> dict:
    """Each field's default in a vLLM request model, but those it makes anew per request (a random
    ``request_id``: a client that leaves it out sends nothing) and the ones a request must set."""
    out = {}
    for name, field in model.model_fields.items():
        if name in ("model", "prompt", "messages"):
            continue
        first, again = field.get_default(call_default_factory=True), field.get_default(call_default_factory=True)
        if first == again:
            out[name] = first
    return out


def _raw(body: dict) -> bytes:
    return json.dumps(body).encode()


def test_every_field_of_vllms_requests_is_a_parameter_here_or_refused_by_name(vllm_requests):
    from vllm.entrypoints.serve.engine.protocol import _REMOVED_GUIDED_FIELDS

    unknown = [(ep, name) for ep, model in vllm_requests.items()
               for name in [*model.model_fields, *_REMOVED_GUIDED_FIELDS]
               if name not in OURS[ep].model_fields and name not in OURS[ep].UNSUPPORTED]
    assert not unknown
    # and the table names only parameters vLLM has (or had: the guided fields)
    for name, e in VLLM_EXTRAS.items():
        for ep in e.endpoints:
            assert name in vllm_requests[ep].model_fields or name in _REMOVED_GUIDED_FIELDS, (ep, name)


def _meaning(body) -> tuple:
    """What a parsed body asks for: the engine request it makes and every field, but the spellings
    of one meaning (``stop: []`` is no stop, ``logprobs: false`` with ``top_logprobs: 0`` no
    logprobs; completions' ``max_tokens: 16`` is the default, see below)."""
    spelt = {"stop", "max_tokens", "logprobs", "top_logprobs"}
    return gen_request([1], body, 8), body.model_dump(exclude=spelt), body.stops(), body.top_logprobs_n()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllms_defaults_are_accepted_and_ask_for_nothing(vllm_requests, endpoint):
    cls, base = OURS[endpoint], BASES[endpoint]
    plain = _meaning(parse(cls, _raw(base)))
    defaults = _vllm_defaults(vllm_requests[endpoint])
    refused = {}
    for name, value in defaults.items():
        try:
            if _meaning(parse(cls, _raw({**base, name: value}))) != plain:
                refused[name] = (value, "parsed to something else than leaving it out")
        except ApiError as exc:
            refused[name] = (value, exc.message)
    assert not refused
    assert _meaning(parse(cls, _raw({**base, **defaults}))) == plain  # all at once, as vLLM's client
    # vLLM's default max_tokens for completions is OpenAI's, the one this API applies too
    assert defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS) in (None, COMPLETION_DEFAULT_MAX_TOKENS)


@pytest.mark.parametrize("endpoint, name", REFUSED)
def test_a_refused_parameter_is_accepted_when_neutral_and_named_otherwise(endpoint, name):
    rule = VLLM_EXTRAS[name].rule
    cls, base = OURS[endpoint], BASES[endpoint]
    for value in rule.accepted:
        assert name not in cls.model_validate({**base, name: value}).model_dump()
    with pytest.raises(ApiError) as info:
        parse(cls, _raw({**base, name: VLLM_ASKING[name]}))
    assert (info.value.status, info.value.param) == (400, name)
    assert info.value.message == f"{name} is not supported: {rule.reason}"


@pytest.mark.parametrize("endpoint, name", IMPLEMENTED)
def test_an_implemented_sampling_parameter_reaches_vllm_and_the_record(endpoint, name):
    rule = VLLM_EXTRAS[name].rule
    also = {"add_generation_prompt": False} if name == "continue_final_message" else {}
    body = parse(OURS[endpoint], _raw({**BASES[endpoint], name: DOING[name], **also}))
    assert getattr(body, name) == DOING[name]
    if rule.carried_by == "prompt":
        return  # the prompt it shaped is recorded: tests/integration/test_serving_vllm_extras.py
    gen = gen_request([1, 2, 3], body, 8)
    engine_side = getattr(vllm_params(gen), name)
    assert (list(engine_side) if isinstance(engine_side, list | tuple) else engine_side) == DOING[name]
    recorded = sampling_record(gen, seed=None, logprobs_mode="processed")
    value = getattr(recorded, name)
    assert (list(value) if isinstance(value, tuple) else value) == DOING[name]
    assert decode(GenerationEvent, encode(_generation(recorded))).sampling == recorded


def _generation(sampling: SamplingParams) -> GenerationEvent:
    return GenerationEvent(
        generation_id="g", group_id="g", model_name="m", model_version=0, user_id="u", endpoint="chat",
        created_at=1.0, completed_at=1.0, latency_ms=1.0, prompt_text="p", prompt_token_ids=(1,),
        completion_text="c", completion_token_ids=(2,), logprobs=(-0.5,), sampling=sampling, finish_reason="stop")


def test_the_neutral_extras_are_not_written_so_old_and_new_records_are_the_same_bytes():
    """A record from before these fields decodes (to their defaults), and a record that does not
    use them is the same bytes as before: a consumer that predates them still reads it."""
    before = (b'{"temperature":0.7,"top_p":0.9,"top_k":40,"max_tokens":8,"seed":null,"stop":["\\n"],'
              b'"logprobs_mode":"processed"}')
    old = SamplingParams.model_validate_json(before, strict=True)
    assert (old.min_p, old.min_tokens, old.stop_token_ids, old.ignore_eos) == (0.0, 0, (), False)
    assert (old.include_stop_str_in_output, old.skip_special_tokens, old.spaces_between_special_tokens) == (
        False, True, True)
    assert old.model_dump_json().encode() == before
    event = _generation(old)
    assert json.loads(encode(event))["sampling"] == json.loads(before)
    used = old.model_copy(update={"min_tokens": 3, "ignore_eos": True})
    assert json.loads(used.model_dump_json()) == {**json.loads(before), "min_tokens": 3, "ignore_eos": True}


def test_the_serving_doc_shows_the_table():
    doc = (Path(__file__).parents[2] / "docs" / "serving-api.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0].strip("`")] = cells[1]
    want = {name: ("implemented" if isinstance(e.rule, Implemented) else "refused unless neutral")
            for name, e in VLLM_EXTRAS.items()}
    assert {name: row.split(",")[0].split(" (")[0] for name, row in rows.items() if name in want} == want
