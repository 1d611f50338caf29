"""Every record that crosses a topic, typed and versioned, shared by producer and consumer.

Each event is a frozen pydantic model told apart by a ``kind`` literal and carrying a
``schema_version``. Producers call :func:`encode`; consumers call :func:`decode` at their edge,
which raises :class:`ContractError` with a machine-readable ``reason`` that the consumer puts on
the dead-letter topic. Records are keyed by ``generation_id`` wherever one exists, so a generation,
its feedback, its episode and its reward land on the same partition number of their topics.

Direction of each record is noted beside its class.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticSerializationError

#: Largest record any consumer accepts before dead-lettering it as ``oversized`` (but see below).
MAX_RECORD_BYTES = 4 * 1024 * 1024
#: Largest feedback body serving's API takes, whatever ``serve.max_body_bytes`` allows (a 413
#: there beats a record ingest would refuse): an edit's text is feedback's only large field.
MAX_FEEDBACK_BODY_BYTES = 1024 * 1024
#: Largest feedback record ingest accepts: such a body plus the fields serving adds.
MAX_FEEDBACK_BYTES = MAX_FEEDBACK_BODY_BYTES + 64 * 1024
#: Largest episode reward accepts: a generation (at most MAX_RECORD_BYTES re-encoded: ingest
#: checks) joined with the text of an edit. Bounded so that every episode, and every dead letter
#: quoting one, fits a produce request (``kafka.max_request_bytes``, 8 MiB by default); ingest
#: dead-letters a generation whose episode would be larger.
MAX_EPISODE_BYTES = MAX_RECORD_BYTES + MAX_FEEDBACK_BYTES + 64 * 1024
#: Records up to this size (key and value) are quoted whole in their dead letter: every record a
#: stage accepts, in base64 (4/3 of it) within the default 8 MiB produce request.
DEADLETTER_QUOTE_BYTES = MAX_EPISODE_BYTES
#: Largest dead letter: a quoted record in base64 (4/3 of its size) with the letter's own fields.
MAX_DEADLETTER_BYTES = DEADLETTER_QUOTE_BYTES * 4 // 3 + 64 * 1024
#: Largest record a stage sends (its dead letters), with room for the produce request's own
#: framing and headers: ``kafka.max_request_bytes`` may not be set below it.
MAX_OUTPUT_REQUEST_BYTES = MAX_DEADLETTER_BYTES + 64 * 1024

Signal = Literal["accept", "reject", "edit", "ignore"]
SIGNALS: tuple[str, ...] = ("accept", "reject", "edit", "ignore")
FinishReason = Literal["stop", "length", "abort"]

#: A time, in seconds since the epoch: finite and before about the year 5100. A NaN or infinite
#: time would poison every window comparison downstream (a NaN deadline is never due, and SQLite
#: stores NaN as NULL), and nothing real happens thousands of years from now.
EpochSeconds = Annotated[float, Field(ge=0.0, lt=1e11, allow_inf_nan=False)]
#: A duration (seconds or milliseconds, as the field says): finite and not negative.
Duration = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
#: A token id. No vocabulary reaches 2**31, and the archives store token ids as int32: a larger
#: one would fail every write of its batch to the archive.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
#: A log-probability as the sampler reports it: finite (the sampled token had a chance). JSON
#: has no NaN or infinity: pydantic writes them as null, which the next consumer then rejects.
#: Within float32's range too, as samplers compute them and the episode archive stores them: a
#: float64 beyond it would be archived as -inf.
Logprob = Annotated[float, Field(allow_inf_nan=False, ge=-3.4e38, le=3.4e38)]
#: A non-negative count or version that fits the int64 of SQLite and the archives.
Int64 = Annotated[int, Field(ge=0, lt=2**63)]


def now() -> float:
    """Wall-clock seconds since the epoch; a function so defaults are taken per record."""
    return time.time()


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = 1


def _extra(default: Any, **bounds: Any) -> Any:
    """A field added to a record after its first version: left out of the JSON at its default, so a
    record that does not use it is the same bytes as before it existed (and a consumer that
    predates it still reads the record), while an old record decodes to the default."""
    return Field(default=default, exclude_if=lambda v: v == default, **bounds)


class SamplingParams(BaseModel):
    """The sampler's settings for one generation: the trainer needs them to recompute logprobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0.0, allow_inf_nan=False)
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: int = -1
    max_tokens: int = Field(ge=1)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: Which distribution ``logprobs`` come from: ``processed`` = after temperature/top-p/top-k
    #: (and min-p, and min_tokens' mask), i.e. the distribution the token was actually drawn from
    #: (what importance sampling needs).
    logprobs_mode: Literal["processed", "raw"] = "processed"
    # vLLM's extras (serving/vllm_extras.py), written only when they ask for something (see
    # _extra). min_p truncates like top_p; min_tokens masks the stop tokens (EOS and
    # stop_token_ids) for the first min_tokens tokens; the others decide when sampling stops or
    # how the tokens became ``completion_text``, and leave each token's distribution alone.
    min_p: float = _extra(0.0, ge=0.0, le=1.0)
    min_tokens: int = _extra(0, ge=0)
    stop_token_ids: tuple[TokenId, ...] = _extra(())
    ignore_eos: bool = _extra(False)
    include_stop_str_in_output: bool = _extra(False)
    skip_special_tokens: bool = _extra(True)
    spaces_between_special_tokens: bool = _extra(True)

    def wire(self) -> dict[str, Any]:
        """The fields as :func:`encode` writes them, for encoders that build JSON from fields."""
        return {k: v for k, v in self.__dict__.items() if k not in _EXTRA_DEFAULTS or v != _EXTRA_DEFAULTS[k]}


_EXTRA_DEFAULTS = {n: f.default for n, f in SamplingParams.model_fields.items() if f.exclude_if is not None}


#: Which of serving's routes answered a request: the stable version, the canary, or a version the
#: request named itself (``flywheel@v12``, evaluation traffic that canary statistics leave out).
Route = Literal["stable", "canary", "pinned"]


class VersionSpan(BaseModel):
    """Completion tokens ``[start, end)`` were sampled by ``version`` (a request that straddled a
    weight swap has two or more)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Int64
    start: int = Field(ge=0)
    end: int = Field(ge=0)


# serving -> ingest
class GenerationEvent(_Event):
    """One sampled completion, complete enough for off-policy RL."""

    kind: Literal["generation"] = "generation"
    generation_id: str = Field(min_length=1, max_length=128)
    #: The API response id; choices of one request (``n > 1``) share it (a GRPO group).
    group_id: str = Field(min_length=1, max_length=128)
    choice_index: int = Field(default=0, ge=0, lt=2**31)
    model_name: str
    model_version: Int64
    user_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal["completions", "chat"]
    created_at: EpochSeconds
    completed_at: EpochSeconds
    latency_ms: Duration
    prompt_text: str
    prompt_token_ids: tuple[TokenId, ...] = Field(min_length=1)
    completion_text: str
    completion_token_ids: tuple[TokenId, ...]
    #: The sampler's log-probability of each sampled completion token, one per token.
    logprobs: tuple[Logprob, ...]
    sampling: SamplingParams
    finish_reason: FinishReason
    #: The route that answered: canary statistics count ``stable`` and ``canary`` only.
    route: Route = "stable"
    #: Set only when some token was sampled by another version than ``model_version`` (the
    #: version the request was routed to and the response names): a weight swap landed while it
    #: ran. Which tokens each version sampled, as vLLM reports it.
    version_spans: tuple[VersionSpan, ...] = ()
    #: Which product API key asked for it, by its id (``key-`` and the first 12 hex digits of an
    #: HMAC of the key under ``serve.user_id_salt``, flywheel/apikeys.py), never the key: usage
    #: is accounted per key (``flywheel usage``). None for a deployment without keys, and in
    #: records written before the field existed, which decode as before.
    api_key_id: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> GenerationEvent:
        if len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for "
                f"{len(self.completion_token_ids)} completion tokens"
            )
        if self.completed_at < self.created_at:
            raise ValueError("completed_at is before created_at")
        if self.version_spans:
            spans = self.version_spans
            bounds_ok = spans[0].start == 0 and spans[-1].end == len(self.completion_token_ids)
            if not bounds_ok or any(a.end != b.start for a, b in itertools.pairwise(spans)) or \
                    any(s.end < s.start for s in spans):
                raise ValueError("version_spans must cover the completion tokens in order")
        return self


# serving -> ingest
class FeedbackEvent(_Event):
    """A user's signal on one generation. ``feedback_id`` is the idempotency key."""

    kind: Literal["feedback"] = "feedback"
    feedback_id: str = Field(min_length=1, max_length=128)
    generation_id: str = Field(min_length=1, max_length=128)
    signal: Signal
    edited_text: str | None = None
    #: Milliseconds the user took to decide, when the product measured it.
    decision_ms: Duration | None = None
    #: The user who sent the feedback, checked by serving to be the generation's own user; None:
    #: the feedback named no user (or serving could not check the one it named), and it is the
    #: generation's user's (docs/serving-api.md, "Feedback").
    user_id: str | None = Field(default=None, max_length=128)
    created_at: EpochSeconds
    received_at: EpochSeconds
    #: True: ``user_id`` is NOT the user the generation was made for, and serving recorded the
    #: feedback anyway (``serve.feedback_other_user = "record"``, for audit). Such feedback is no
    #: one's judgement of the answer: ingest never folds it into an episode's signal
    #: (ingest/join.py ``resolve``), so it never reaches reward, a canary's outcomes or training.
    other_user: bool = _extra(False)

    @model_validator(mode="after")
    def _edit_has_text(self) -> FeedbackEvent:
        if self.signal == "edit" and self.edited_text is None:
            raise ValueError("signal 'edit' needs edited_text")
        return self


# ingest -> reward
class EpisodeEvent(_Event):
    """A generation joined with its resolved user signal (``ignore`` when none came in time)."""

    kind: Literal["episode"] = "episode"
    generation: GenerationEvent
    signal: Signal
    edited_text: str | None = None
    decision_ms: Duration | None = None
    #: Every distinct feedback id that was folded into ``signal``.
    feedback_ids: tuple[str, ...] = ()
    #: True when the window closed with no feedback (``signal`` is then ``ignore``).
    timed_out: bool = False
    #: True when feedback for this generation disagreed and the resolution rule picked one.
    conflicted: bool = False
    #: ``user_id`` of the feedback whose signal won: the user who judged the generation, whom
    #: reward's abuse guards count. None when no feedback came or it named no user (the guards
    #: then count the generation's user). Usually that same user; not when one account rates
    #: other users' generations, which is what the guards must see.
    rater_id: str | None = Field(default=None, max_length=128)
    resolved_at: EpochSeconds

    @model_validator(mode="after")
    def _signal_fits_how_it_resolved(self) -> EpisodeEvent:
        # What ingest's resolution (ingest/join.py) can produce: reward relies on it, e.g. a
        # timed-out episode is skipped as having no signal, whatever its ``signal`` says.
        if self.timed_out and (self.signal != "ignore" or self.feedback_ids or self.rater_id is not None):
            raise ValueError("a timed-out episode had no feedback: its signal is 'ignore', "
                             "feedback_ids empty and rater_id null")
        if self.signal == "edit" and self.edited_text is None:
            raise ValueError("signal 'edit' needs edited_text")
        return self

    @property
    def generation_id(self) -> str:
        return self.generation.generation_id


# reward -> trainer
class RewardEvent(_Event):
    """A labeled sample: tokens, behaviour logprobs, the scalar reward and how it was made."""

    kind: Literal["reward"] = "reward"
    generation_id: str = Field(min_length=1, max_length=128)
    group_id: str
    #: The generation's user.
    user_id: str
    #: The user whose signal this is, as in ``EpisodeEvent.rater_id``: the one the abuse guards
    #: judged (``user_id`` when None).
    rater_id: str | None = Field(default=None, max_length=128)
    model_version: Int64
    signal: Signal
    prompt_token_ids: tuple[TokenId, ...] = Field(min_length=1)
    completion_token_ids: tuple[TokenId, ...]
    logprobs: tuple[float, ...]
    sampling: SamplingParams
    reward: float
    #: Named parts of ``reward`` (e.g. ``signal``, ``edit``, ``length_penalty``).
    components: dict[str, float] = Field(default_factory=dict)
    #: Sample weight in [0, 1] after abuse guards (down-weighted users get < 1).
    weight: float = Field(default=1.0, ge=0.0, le=1.0)
    #: Guard flags: :data:`ABUSE_FLAGS` (about the user) and :data:`HACKING_FLAGS` (about the answer).
    flags: tuple[str, ...] = ()
    generated_at: EpochSeconds
    labeled_at: EpochSeconds


#: Reward-guard flags judged per user: they describe who gave the signal, not what the model did.
ABUSE_FLAGS: tuple[str, ...] = ("user_cap", "constant_user", "rate_anomaly")
#: Reward-guard flags judged per answer: a model buying reward with length or repetition.
HACKING_FLAGS: tuple[str, ...] = ("long", "repetition")


class BaseModelRef(BaseModel):
    """The base model an adapter version applies to (LoRA training: docs/trainer.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The base's name (its directory's, as the trainer loaded it): for people and logs.
    name: str = Field(min_length=1, max_length=256)
    #: sha256 of the base directory's ``flywheel-manifest.json``: a reader loads the adapter only
    #: on a base whose manifest hashes to this (flywheel.checkpoints.verify_base).
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


# trainer -> serving, release
class CheckpointEvent(_Event):
    """A published policy version in the checkpoint store."""

    kind: Literal["checkpoint"] = "checkpoint"
    version: int = Field(ge=0)
    parent: int | None = None
    step: int = Field(ge=0)
    #: Where the version lives in the checkpoint store (a local path or an fsspec URL). Bounded as
    #: :class:`VersionRef`'s is: the release record carries it to serving, and one the controller
    #: took but could never publish held back every later routing.
    uri: str = Field(min_length=1, max_length=4096)
    #: sha256 of the version's manifest file; serving refuses weights that do not match.
    manifest_sha256: str = Field(min_length=64, max_length=64)
    dtype: str
    full_snapshot: bool
    samples: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    created_at: EpochSeconds
    #: Set when the version is a LoRA adapter (a PEFT directory) on this base, not full weights.
    base: BaseModelRef | None = _extra(None)


class VersionRef(BaseModel):
    """Where a released version lives and the manifest hash its checkpoint event announced."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=1)
    uri: str = Field(min_length=1, max_length=4096)
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: Set when the version is a LoRA adapter on this base (its checkpoint event's ``base``).
    base: BaseModelRef | None = _extra(None)


# release -> serving
class ReleaseEvent(_Event):
    """Desired routing: which version is stable, which is canary, and the canary's share.

    Every version above 0 comes with a :class:`VersionRef` (``stable_ref`` / ``canary_ref``), so
    serving fetches and verifies it from this record alone; version 0 is the model directory
    serving was started with.
    """

    kind: Literal["release"] = "release"
    revision: int = Field(ge=0)
    #: The deployment this routing is for (``release.deployment``); serving follows its own only.
    deployment: str = Field(default="flywheel", min_length=1, max_length=128)
    stable_version: int = Field(ge=0)
    #: At least 1: version 0 is the model directory, never a canary (a canary of -1 once passed
    #: here and stopped every serving start that read it).
    canary_version: int | None = Field(default=None, ge=1)
    canary_share: float = Field(default=0.0, ge=0.0, le=1.0)
    #: Salts the hash that picks the canary's users (serving/routing.py): the controller gives
    #: each canary its own, so each draws a fresh split, kept for the whole canary. Empty (every
    #: record before salts): the unsalted hash, so an old record routes as it did.
    canary_salt: str = _extra("", max_length=256)
    stable_ref: VersionRef | None = None
    canary_ref: VersionRef | None = None
    reason: str = ""
    updated_at: EpochSeconds

    @model_validator(mode="after")
    def _refs_name_their_versions(self) -> ReleaseEvent:
        if self.canary_version is None and self.canary_ref is not None:
            raise ValueError("canary_ref without a canary_version")
        if self.canary_version is None and self.canary_salt:
            raise ValueError("canary_salt without a canary_version")
        for role, version, ref in (("stable", self.stable_version, self.stable_ref),
                                   ("canary", self.canary_version, self.canary_ref)):
            if ref is not None and ref.version != version:
                raise ValueError(f"{role}_ref is for version {ref.version}, not {role}_version {version}")
            if version is not None and version > 0 and ref is None:
                raise ValueError(f"{role}_version {version} has no {role}_ref saying where it is")
        if self.canary_version is not None and self.canary_version == self.stable_version:
            raise ValueError("canary_version equals stable_version")
        return self


#: What serving did with one release record (:class:`ServingStatusEvent`).
ServingOutcome = Literal["applied", "refused"]


# serving -> release
class ServingStatusEvent(_Event):
    """What one serving instance did with a release record: applied it, or refused it and why.

    Serving writes one per release it acts on (``flywheel.serving-status``, keyed by deployment);
    the release controller reads them each turn, rolls back a canary serving refused and takes
    back a promotion serving refused, so its view of stable stays what serving serves."""

    kind: Literal["serving_status"] = "serving_status"
    deployment: str = Field(min_length=1, max_length=128)
    #: Which serving process this is (host and pid): several serve one deployment, each says.
    instance: str = Field(min_length=1, max_length=256)
    #: The release record's revision, and what it asked for.
    revision: int = Field(ge=0)
    outcome: ServingOutcome
    stable_version: int = Field(ge=0)
    canary_version: int | None = Field(default=None, ge=1)
    #: After this record: the version serving's stable route serves (a refusal keeps the one it had).
    serving_stable_version: int = Field(ge=0)
    #: For ``refused``: the version that failed, and serving's reason code and words
    #: (serving/follow.py: the checkpoint fetch's refusals, ``load_failed``, ``no_canary_engine``...).
    refused_version: int | None = Field(default=None, ge=0)
    reason: str = Field(default="", max_length=64)
    detail: str = Field(default="", max_length=4096)
    at: EpochSeconds

    @model_validator(mode="after")
    def _refusals_say_why(self) -> ServingStatusEvent:
        if (self.outcome == "refused") != bool(self.reason):
            raise ValueError("a refusal, and only a refusal, carries a reason")
        if self.outcome == "refused" and self.refused_version is None:
            raise ValueError("a refusal names the version refused")
        return self


# any stage -> deadletter
class DeadLetterEvent(_Event):
    """A record a stage could not use, with the original bytes and where they came from."""

    kind: Literal["deadletter"] = "deadletter"
    stage: str
    reason: str
    detail: str = ""
    source_topic: str
    source_partition: Int64 | None = None
    source_offset: Int64 | None = None
    #: Original key and value, base64 so arbitrary bytes survive JSON.
    key_b64: str | None = None
    value_b64: str = ""
    #: True when the record was too large to quote whole (``key_b64``/``value_b64`` then hold
    #: only its start, and ``detail`` says how large it was): the whole record stays in its source
    #: topic at ``source_partition``/``source_offset`` until the topic's retention removes it.
    truncated: bool = False
    failed_at: EpochSeconds

    @field_validator("key_b64", "value_b64")
    @classmethod
    def _is_base64(cls, text: str | None) -> str | None:
        # checked on arrival: `flywheel deadletters show/replay` decode it later, and a letter
        # written by some other tool must be unreadable there, not a crash
        if text is not None:
            try:
                base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("not base64") from None
        return text


Event = Annotated[
    GenerationEvent
    | FeedbackEvent
    | EpisodeEvent
    | RewardEvent
    | CheckpointEvent
    | ReleaseEvent
    | ServingStatusEvent
    | DeadLetterEvent,
    Field(discriminator="kind"),
]

E = TypeVar("E", bound=_Event)

#: Schema versions each kind's consumers understand.
SUPPORTED_VERSIONS: dict[str, frozenset[int]] = {
    "generation": frozenset({1}),
    "feedback": frozenset({1}),
    "episode": frozenset({1}),
    "reward": frozenset({1}),
    "checkpoint": frozenset({1}),
    "release": frozenset({1}),
    "serving_status": frozenset({1}),
    "deadletter": frozenset({1}),
}


#: Every ``reason`` :func:`decode` gives a :class:`ContractError`.
CONTRACT_REASONS: tuple[str, ...] = ("empty", "oversized", "undecodable", "wrong_kind", "unknown_version", "invalid")


class ContractError(ValueError):
    """A record that does not satisfy its contract. ``reason`` is a short stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def encode(event: _Event) -> bytes:
    """Serialise an event to its wire form (UTF-8 JSON)."""
    return event.model_dump_json().encode("utf-8")


def decode(cls: type[E], raw: bytes | None, *, max_bytes: int = MAX_RECORD_BYTES) -> E:
    """Decode and validate one record as ``cls``; raise :class:`ContractError` on any failure.

    Reasons: ``empty``, ``oversized``, ``undecodable`` (not UTF-8 JSON), ``wrong_kind``,
    ``unknown_version``, ``invalid`` (fails the schema; ``detail`` names the fields).
    """
    if not raw:
        raise ContractError("empty", "record has no value")
    if len(raw) > max_bytes:
        raise ContractError("oversized", f"{len(raw)} bytes > limit {max_bytes}")
    # Fast path, about 3x cheaper: pydantic parses and validates the bytes in one pass, in the
    # same strict mode as the checked path below, so an event it returns is the one the checked
    # path would return. Anything it rejects takes the checked path, which alone decides the
    # dead-letter reason.
    try:
        event = cls.model_validate_json(raw, strict=True)
    except ValidationError:
        event = None
    if event is None or event.schema_version not in SUPPORTED_VERSIONS[event.kind]:
        event = _decode_checked(cls, raw)
    # (looked up in __dict__: on a model without the field, getattr goes through pydantic's
    # __getattr__ and an AttributeError, about 2.7 us, more than validating a feedback record)
    if (inner := event.__dict__.get("generation")) is not None and \
            inner.schema_version not in SUPPORTED_VERSIONS[inner.kind]:
        # an episode carries its generation whole: a consumer that does not know that
        # generation's version does not know the episode either (replay it after the upgrade)
        raise ContractError("unknown_version", f"{event.kind}'s {inner.kind} schema_version "
                                               f"{inner.schema_version!r} not supported")
    if may_hold_surrogates(raw):
        _check_encodable(event)
    return event


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether JSON text has a ``\\udXXX`` escape: only then can a parsed string hold a lone
    surrogate, so the (costlier) check of the parsed value can be skipped for the rest."""
    return b"\\u" in raw and (b"\\ud" in raw or b"\\uD" in raw)  # (one scan when there is no escape)


_LONE_SURROGATE = "a string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair)"


def _check_encodable(event: _Event) -> None:
    """Refuse strings that cannot be written back as UTF-8.

    A JSON ``\\udXXX`` escape without its pair parses into a Python string that no UTF-8
    encoder accepts, so the first stage to re-encode the record (ingest stores every generation
    re-encoded) would fail its whole batch on it. Paired escapes (emoji from an ASCII-only
    encoder) are fine; the check runs only for records that contain such an escape at all.
    """
    try:
        event.model_dump_json()
    except PydanticSerializationError:
        raise ContractError("invalid", _LONE_SURROGATE) from None


def _check_encodable_json(obj: object) -> None:
    """:func:`_check_encodable` for a parsed JSON value."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ContractError("invalid", _LONE_SURROGATE) from None


def _decode_checked(cls: type[E], raw: bytes) -> E:
    """:func:`decode` step by step, so a failure names its reason."""
    try:
        # Strictly UTF-8 first: json.loads(bytes) would also take UTF-16 and UTF-32, a byte-order
        # mark and surrogates encoded as raw bytes, none of which the stages' own parser (used
        # on stored records, e.g. feedback when its window closes) reads back.
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ContractError("undecodable", f"not UTF-8: {exc}") from None
    except RecursionError:
        raise ContractError("undecodable", "JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and an integer past Python's digit limit
        raise ContractError("undecodable", f"not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ContractError("undecodable", f"expected a JSON object, got {type(obj).__name__}")
    want = cls.model_fields["kind"].default
    if obj.get("kind", want) != want:
        raise ContractError("wrong_kind", f"expected kind {want!r}, got {obj.get('kind')!r}")
    version = obj.get("schema_version", 1)
    if not isinstance(version, (int, float, str)) or version not in SUPPORTED_VERSIONS[want]:
        # (a list or an object is no version either, and cannot even be looked up)
        raise ContractError("unknown_version", f"{want} schema_version {version!r} not supported")
    if may_hold_surrogates(raw):
        _check_encodable_json(obj)  # (pydantic's parser below refuses them too, but names no reason)
    try:
        # Strict, and on the JSON text: lax mode reads "3" and true as the integers 3 and 1 (a
        # version named by text, a bool read as a count), where JSON's own types say what the
        # producer meant. Strict JSON mode still reads an integer where a float belongs, and an
        # array as a tuple, as every producer writes them.
        return cls.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise ContractError("invalid", _summarise(exc)) from None


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Topics:
    """Topic names under one prefix (``FLYWHEEL_TOPIC_PREFIX``, default ``flywheel.``)."""

    prefix: str = "flywheel."

    @property
    def generations(self) -> str:
        return f"{self.prefix}generations"

    @property
    def feedback(self) -> str:
        return f"{self.prefix}feedback"

    @property
    def episodes(self) -> str:
        return f"{self.prefix}episodes"

    @property
    def rewards(self) -> str:
        return f"{self.prefix}rewards"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}checkpoints"

    @property
    def releases(self) -> str:
        return f"{self.prefix}releases"

    @property
    def serving_status(self) -> str:
        return f"{self.prefix}serving-status"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}deadletter"

    def all(self) -> tuple[str, ...]:
        return (
            self.generations,
            self.feedback,
            self.episodes,
            self.rewards,
            self.checkpoints,
            self.releases,
            self.serving_status,
            self.deadletter,
        )


