"""Wire contracts: round trips, and every way a record can be bad maps to a stable reason."""

import json

import pytest
from pydantic import ValidationError

from flywheel.contracts import (
    CONTRACT_REASONS,
    ContractError,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)


def _generation(**kw):
    base = {
        "generation_id": "g1",
        "group_id": "g1",
        "model_name": "m",
        "model_version": 0,
        "user_id": "u1",
        "endpoint": "completions",
        "created_at": 1.0,
        "completed_at": 2.0,
        "latency_ms": 1000.0,
        "prompt_text": "hi",
        "prompt_token_ids": (1, 2),
        "completion_text": "yo",
        "completion_token_ids": (3, 4, 5),
        "logprobs": (-0.1, -0.2, -0.3),
        "sampling": SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),
        "finish_reason": "length",
    }
    base.update(kw)
    return GenerationEvent(**base)


def test_generation_round_trip():
    g = _generation()
    assert decode(GenerationEvent, encode(g)) == g


def test_a_generation_recorded_before_api_key_id_still_decodes():
    g = _generation(api_key_id="key-0123456789ab")
    assert decode(GenerationEvent, encode(g)).api_key_id == "key-0123456789ab"
    old = json.loads(encode(g))
    del old["api_key_id"]  # as serving wrote it before the field existed
    got = decode(GenerationEvent, json.dumps(old).encode())
    assert got.api_key_id is None and got == g.model_copy(update={"api_key_id": None})
    episode = decode(EpisodeEvent, json.dumps({"kind": "episode", "generation": old, "signal": "accept",
                                               "resolved_at": 3.0}).encode())
    assert episode.generation.api_key_id is None


def test_logprobs_must_match_tokens():
    with pytest.raises(ValueError, match="logprobs has 2 entries for 3"):
        _generation(logprobs=(-0.1, -0.2))


def test_edit_needs_text():
    with pytest.raises(ValueError, match="edited_text"):
        FeedbackEvent(feedback_id="f", generation_id="g", signal="edit", created_at=1, received_at=1)


@pytest.mark.parametrize("fields, error", [
    ({"signal": "ignore", "timed_out": True}, None),
    ({"signal": "ignore", "feedback_ids": ("f",)}, None),  # an explicit ignore
    ({"signal": "accept", "feedback_ids": ("f",)}, None),
    ({"signal": "edit", "edited_text": "x", "feedback_ids": ("f",)}, None),
    ({"signal": "accept", "timed_out": True}, "timed-out episode"),
    ({"signal": "ignore", "timed_out": True, "feedback_ids": ("f",)}, "timed-out episode"),
    ({"signal": "ignore", "timed_out": True, "rater_id": "r"}, "timed-out episode"),
    ({"signal": "accept", "rater_id": "r"}, None),
    ({"signal": "accept", "rater_id": "r" * 129}, "rater_id"),
    ({"signal": "edit", "feedback_ids": ("f",)}, "edited_text"),
])
def test_an_episode_signal_must_fit_how_it_resolved(fields, error):
    """Episodes ingest cannot produce are invalid at reward's edge: a timed-out ``accept`` was
    skipped there as having no signal, an ``edit`` without text labeled as no edit at all."""
    raw = encode(EpisodeEvent.model_construct(generation=_generation(), resolved_at=3.0, **fields))
    if error is None:
        assert decode(EpisodeEvent, raw).signal == fields["signal"]
    else:
        with pytest.raises(ContractError, match=error) as exc:
            decode(EpisodeEvent, raw)
        assert exc.value.reason == "invalid"


_DECODE_CASES = [
    (b"", "empty"),
    (b"\xff\xfe", "undecodable"),
    (b"[1, 2]", "undecodable"),
    (b"{not json", "undecodable"),
    (b"[" * 100_000 + b"]" * 100_000, "undecodable"),  # once a RecursionError that failed the batch
    (b'{"kind": "feedback", "feedback_id": ' + b"[" * 5000 + b"]" * 5000 + b"}", "undecodable"),
    (json.dumps({"kind": "generation"}).encode(), "wrong_kind"),
    (json.dumps({"kind": "feedback", "schema_version": 99}).encode(), "unknown_version"),
    (json.dumps({"kind": "feedback", "feedback_id": "f"}).encode(), "invalid"),
    (
        json.dumps(
            {"kind": "feedback", "feedback_id": "f", "generation_id": "g", "signal": "love",
             "created_at": 1, "received_at": 1}
        ).encode(),
        "invalid",
    ),
    (b"{" + b" " * 200 + b"}", "oversized"),
]


@pytest.mark.parametrize(("raw", "reason"), _DECODE_CASES)
def test_decode_reasons(raw, reason):
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, raw, max_bytes=len(raw) if reason != "oversized" else 64)
    assert info.value.reason == reason
    assert info.value.detail
    assert reason in CONTRACT_REASONS  # declared, so every stage exports its count at 0


def test_every_declared_contract_reason_is_tested():
    """CONTRACT_REASONS is what the stages pre-register; no stale entry hides in it."""
    tested = {reason for _, reason in _DECODE_CASES}
    assert tested == set(CONTRACT_REASONS)


_FEEDBACK = {"kind": "feedback", "feedback_id": "f", "generation_id": "g", "signal": "accept",
             "created_at": 1, "received_at": 2}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # valid records the strict fast path rejects: the checked path still decides
        ({"schema_version": 2}, "unknown_version"),  # a well-typed version the fast path parses
        ({"schema_version": "1"}, "unknown_version"),  # lax pydantic would coerce "1" to 1
        ({"schema_version": []}, "unknown_version"),  # once a TypeError that failed the batch
        ({"schema_version": {"v": 1}}, "unknown_version"),
        ({"kind": "episode"}, "wrong_kind"),
        ({"signal": "edit"}, "invalid"),  # the model validator runs on both paths
    ],
)
def test_decode_reasons_with_fast_path_candidates(change, reason):
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, json.dumps({**_FEEDBACK, **change}).encode())
    assert info.value.reason == reason


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(_FEEDBACK).encode(),
        # (1.0 or true as schema_version, "1.5" as a time: refused on both paths,
        # tests/unit/test_contracts_strict.py)
        json.dumps({k: v for k, v in _FEEDBACK.items() if k != "kind"}).encode(),  # kind defaulted
        b'{"feedback_id": "x", ' + json.dumps(_FEEDBACK).encode()[1:],  # duplicate key: last wins
        b"  " + json.dumps(_FEEDBACK).encode() + b"\n",
    ],
)
def test_decode_matches_the_checked_path(raw):
    """Whichever path decodes a record, the event is the one json.loads + model_validate gives."""
    assert decode(FeedbackEvent, raw) == FeedbackEvent.model_validate(json.loads(raw))


@pytest.mark.parametrize("field", ["created_at", "received_at", "decision_ms"])
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-5", b"1e12"])
def test_times_must_be_finite_and_plausible(field, literal):
    """Python's json and pydantic's parser both read NaN and Infinity: a record carrying one
    would never close its join window (and SQLite would store it as NULL), so it is invalid."""
    raw = json.dumps({**_FEEDBACK, field: 12345.5}).encode().replace(b"12345.5", literal)
    if field == "decision_ms" and literal == b"1e12":
        assert decode(FeedbackEvent, raw).decision_ms == 1e12  # a duration has no upper bound
        return
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, raw)
    assert (info.value.reason, info.value.detail.split(":")[0]) == ("invalid", field)


@pytest.mark.parametrize("change, field", [
    ({"completion_token_ids": [3, 4, 2**31]}, "completion_token_ids.2"),  # the archives' int32
    ({"prompt_token_ids": [-1, 2]}, "prompt_token_ids.0"),
    ({"model_version": 2**63}, "model_version"),  # SQLite's and the archives' int64
    ({"choice_index": 2**31}, "choice_index"),
    ({"latency_ms": float("inf")}, "latency_ms"),
    ({"logprobs": [-0.1, float("nan"), -0.3]}, "logprobs.1"),  # pydantic would write it as null
    ({"logprobs": [-0.1, -0.2, -1e300]}, "logprobs.2"),  # the archive's float32 would make it -inf
    ({"sampling": {"temperature": float("inf"), "top_p": 1.0, "max_tokens": 8}}, "sampling.temperature"),
])
def test_generation_numbers_fit_where_they_are_stored(change, field):
    obj = {**json.loads(encode(_generation())), **change}
    with pytest.raises(ContractError) as info:
        decode(GenerationEvent, json.dumps(obj).encode())
    assert (info.value.reason, info.value.detail.split(":")[0]) == ("invalid", field)
    largest = {**json.loads(encode(_generation())), "completion_token_ids": [3, 4, 2**31 - 1],
               "model_version": 2**63 - 1, "logprobs": [-0.1, -0.2, -3.4e38]}
    got = decode(GenerationEvent, json.dumps(largest).encode())
    assert got.completion_token_ids[-1] == 2**31 - 1 and got.logprobs[-1] == -3.4e38


@pytest.mark.parametrize("escape, ok", [
    (b"\\ud83d\\ude00", True),  # a pair: an emoji from an ASCII-only JSON encoder
    (b"\\uD83D\\uDE00", True),
    (b"\\ud800", False),  # a lone high surrogate
    (b"x\\udc00y", False),  # a lone low one
    (b"\\uDBFF", False),
    (b"\\\\udir", True),  # an escaped backslash before "udir", not an escape
])
def test_lone_surrogates_are_invalid(escape, ok):
    """A lone surrogate parses into a str no UTF-8 encoder takes: the first stage to re-encode
    the record would fail its whole batch on it."""
    raw = json.dumps({**_FEEDBACK, "signal": "edit", "edited_text": "T"}).encode().replace(b'"T"', b'"' + escape + b'"')
    if ok:
        event = decode(FeedbackEvent, raw)
        assert event == FeedbackEvent.model_validate(json.loads(raw))
        assert decode(FeedbackEvent, encode(event)) == event
        return
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, raw)
    assert info.value.reason == "invalid" and "surrogate" in info.value.detail


def test_trailing_bytes_are_undecodable():
    with pytest.raises(ContractError) as info:
        decode(FeedbackEvent, json.dumps(_FEEDBACK).encode() + b" x")
    assert info.value.reason == "undecodable"


def test_invalid_detail_names_the_field():
    raw = json.dumps(
        {"kind": "feedback", "feedback_id": "f", "generation_id": "g", "signal": "love",
         "created_at": 1, "received_at": 1}
    ).encode()
    with pytest.raises(ContractError, match="signal"):
        decode(FeedbackEvent, raw)


def test_unknown_fields_are_rejected():
    raw = json.loads(encode(_generation()))
    raw["surprise"] = 1
    with pytest.raises(ContractError) as info:
        decode(GenerationEvent, json.dumps(raw).encode())
    assert info.value.reason == "invalid"


def test_topics_follow_prefix():
    t = Topics("x.")
    assert t.generations == "x.generations"
    assert t.deadletter == "x.deadletter"
    assert t.serving_status == "x.serving-status"
    assert len(set(t.all())) == 8


@pytest.mark.parametrize("version, reason", [(1, None), (2, "unknown_version"), (0, "unknown_version"),
                                             (1.0, "invalid")])  # (not an integer: strict)
def test_an_episode_is_unknown_when_its_generation_is(version, reason):
    """An episode carries its generation whole: a reward stage that does not know a generation's
    version must dead-letter its episode (for a replay after the upgrade), not label it."""
    episode = json.loads(encode(EpisodeEvent(generation=_generation(), signal="accept", resolved_at=3.0)))
    episode["generation"]["schema_version"] = version
    raw = json.dumps(episode).encode()
    if reason is None:
        assert decode(EpisodeEvent, raw).generation.schema_version == 1
    else:
        with pytest.raises(ContractError) as info:
            decode(EpisodeEvent, raw)
        needle = {"unknown_version": "episode's generation schema_version",
                  "invalid": "generation.schema_version: Input should be a valid integer"}[reason]
        assert info.value.reason == reason and needle in info.value.detail


def test_a_release_carries_its_canarys_salt_and_an_old_record_decodes_without_one():
    from flywheel.contracts import ReleaseEvent, VersionRef

    ref = VersionRef(version=5, uri="s3://b/v00000005", manifest_sha256="b" * 64)
    salted = ReleaseEvent(revision=2, stable_version=0, canary_version=5, canary_ref=ref, canary_share=0.1,
                          canary_salt="flywheel/v5/bbbb", updated_at=1.0)
    assert decode(ReleaseEvent, encode(salted)).canary_salt == "flywheel/v5/bbbb"
    # a record without one (written before salts) is the same bytes as before and routes unsalted
    plain = salted.model_copy(update={"canary_salt": ""})
    assert b"canary_salt" not in encode(plain) and decode(ReleaseEvent, encode(plain)).canary_salt == ""
    with pytest.raises(ValidationError, match="canary_salt without a canary_version"):
        ReleaseEvent(revision=1, stable_version=0, canary_salt="x", updated_at=1.0)


def test_a_release_names_where_each_version_lives():
    from flywheel.contracts import ReleaseEvent, VersionRef

    ref = VersionRef(version=3, uri="s3://b/v00000003", manifest_sha256="a" * 64)
    ok = ReleaseEvent(revision=1, stable_version=3, stable_ref=ref, updated_at=1.0)
    assert ok.stable_ref == ref and ReleaseEvent(revision=1, stable_version=0, updated_at=1.0).stable_ref is None
    for bad, needle in (({"stable_version": 3}, "has no stable_ref"),
                        ({"stable_version": 4, "stable_ref": ref}, "not stable_version 4"),
                        ({"stable_version": 3, "stable_ref": ref, "canary_version": 3, "canary_ref": ref},
                         "equals stable_version"),
                        # no version below 1 is a canary: -1 once stopped serving from starting
                        ({"stable_version": 0, "canary_version": -1}, "(?s)canary_version.*greater than or equal to 1"),
                        ({"stable_version": 1, "stable_ref": ref.model_copy(update={"version": 1}),
                          "canary_version": 0}, "(?s)canary_version.*greater than or equal to 1"),
                        ({"stable_version": 0, "canary_ref": ref}, "canary_ref without")):
        with pytest.raises(ValidationError, match=needle):
            ReleaseEvent(revision=1, updated_at=1.0, **bad)
