"""Decoding is strict: a string or a bool where the contract has an integer is ``invalid``.

Lax pydantic coerces ``"3"`` and ``true`` to integers, so a producer that wrote a version as text,
or a bool for a count, would be read as meaning something it never said (``true`` as version 1).
An integer where a float belongs is a number all the same (JSON writes ``1.0`` as ``1`` in many
encoders), so it stays accepted. Each record is built through the contract and then bent.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.contracts import (
    CheckpointEvent,
    ContractError,
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    ReleaseEvent,
    RewardEvent,
    SamplingParams,
    VersionRef,
    decode,
    encode,
)

_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8)
_GENERATION = GenerationEvent(
    generation_id="g1", group_id="g1", model_name="m", model_version=3, user_id="u1", endpoint="chat",
    created_at=1.0, completed_at=2.0, latency_ms=5.0, prompt_text="hi", prompt_token_ids=(1, 2),
    completion_text="yo", completion_token_ids=(3, 4), logprobs=(-0.1, -0.2), sampling=_SAMPLING,
    finish_reason="stop",
)
_REF = VersionRef(version=3, uri="file:///store/v00000003", manifest_sha256="a" * 64)

EXAMPLES: dict[type, Any] = {
    GenerationEvent: _GENERATION,
    FeedbackEvent: FeedbackEvent(feedback_id="f", generation_id="g1", signal="accept", created_at=1.0,
                                 received_at=2.0),
    EpisodeEvent: EpisodeEvent(generation=_GENERATION, signal="accept", feedback_ids=("f",), resolved_at=3.0),
    RewardEvent: RewardEvent(generation_id="g1", group_id="g1", user_id="u1", model_version=3, signal="accept",
                             prompt_token_ids=(1, 2), completion_token_ids=(3, 4), logprobs=(-0.1, -0.2),
                             sampling=_SAMPLING, reward=1.0, generated_at=2.0, labeled_at=3.0),
    CheckpointEvent: CheckpointEvent(version=3, parent=2, step=30, uri="file:///store/v00000003",
                                     manifest_sha256="a" * 64, dtype="bfloat16", full_snapshot=False, samples=64,
                                     created_at=1.0),
    ReleaseEvent: ReleaseEvent(revision=4, stable_version=3, stable_ref=_REF, updated_at=1.0),
    DeadLetterEvent: DeadLetterEvent(stage="ingest", reason="invalid", source_topic="t", source_partition=0,
                                     source_offset=7, failed_at=1.0),
}

#: Per kind, integer fields (a dotted path into the record) and one bool field where it has one.
INT_FIELDS: list[tuple[type, str]] = [
    (GenerationEvent, "model_version"),
    (GenerationEvent, "choice_index"),
    (GenerationEvent, "sampling.max_tokens"),
    (GenerationEvent, "prompt_token_ids.0"),
    (FeedbackEvent, "schema_version"),  # its only integer ("1" as text is an unknown version, below)
    (EpisodeEvent, "generation.model_version"),
    (EpisodeEvent, "generation.sampling.max_tokens"),
    (RewardEvent, "model_version"),
    (RewardEvent, "completion_token_ids.1"),
    (CheckpointEvent, "version"),
    (CheckpointEvent, "parent"),
    (CheckpointEvent, "step"),
    (CheckpointEvent, "samples"),
    (ReleaseEvent, "revision"),
    (ReleaseEvent, "stable_version"),
    (ReleaseEvent, "stable_ref.version"),
    (DeadLetterEvent, "source_partition"),
    (DeadLetterEvent, "source_offset"),
]


def _bend(cls: type, path: str, value: Any) -> bytes:
    obj = json.loads(encode(EXAMPLES[cls]))
    *parents, last = path.split(".")
    at = obj
    for key in parents:
        at = at[int(key)] if isinstance(at, list) else at[key]
    at[int(last) if isinstance(at, list) else last] = value(at[int(last) if isinstance(at, list) else last])
    return json.dumps(obj).encode()


def test_every_example_decodes_as_it_was_built():
    for cls, event in EXAMPLES.items():
        assert decode(cls, encode(event)) == event


#: Each integer field as text and as ``true`` (which lax mode reads as 1), except the feedback's
#: schema_version as text: that is an unknown version (below).
BENT = [(cls, path, bent) for cls, path in INT_FIELDS for bent in ("string", "bool")
        if (cls, bent) != (FeedbackEvent, "string")]


@pytest.mark.parametrize(("cls", "path", "bent"), BENT, ids=[f"{c.__name__}.{p}-{b}" for c, p, b in BENT])
def test_a_string_or_a_bool_where_an_integer_belongs_is_invalid(cls, path, bent):
    raw = _bend(cls, path, str if bent == "string" else (lambda _: True))
    with pytest.raises(ContractError) as info:
        decode(cls, raw)
    assert info.value.reason == "invalid"
    assert f"{path}: Input should be a valid integer" in info.value.detail


@pytest.mark.parametrize(("cls", "path", "value"), [
    (GenerationEvent, "schema_version", 1.0),  # a float is no integer either, however round
    (CheckpointEvent, "version", 3.0),
    (ReleaseEvent, "canary_share", True),  # a bool is no number where a float belongs
    (FeedbackEvent, "created_at", "1.5"),  # nor is text
    (EpisodeEvent, "timed_out", 0),  # and an integer is no bool
    (CheckpointEvent, "full_snapshot", "false"),
])
def test_other_values_of_the_wrong_json_type_are_invalid(cls, path, value):
    with pytest.raises(ContractError) as info:
        decode(cls, _bend(cls, path, lambda _: value))
    assert info.value.reason == "invalid" and info.value.detail.startswith(f"{path}: Input should be a valid ")


def test_a_schema_version_as_text_is_an_unknown_version():
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, _bend(FeedbackEvent, "schema_version", str))
    assert info.value.reason == "unknown_version"


@pytest.mark.parametrize(("cls", "path"), [
    (GenerationEvent, "created_at"),
    (GenerationEvent, "latency_ms"),
    (GenerationEvent, "sampling.temperature"),
    (GenerationEvent, "sampling.top_p"),
    (GenerationEvent, "logprobs.0"),
    (RewardEvent, "reward"),
    (RewardEvent, "weight"),
    (ReleaseEvent, "canary_share"),
    (DeadLetterEvent, "failed_at"),
])
def test_an_integer_where_a_float_belongs_is_accepted(cls, path):
    raw = _bend(cls, path, lambda v: int(v) if v >= 0 else -1)
    got = decode(cls, raw)
    at: Any = got
    for key in path.split("."):
        at = at[int(key)] if key.isdigit() else getattr(at, key)
    assert isinstance(at, float) and at == int(at)
