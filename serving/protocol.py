"""The HTTP wire format: OpenAI-compatible request and response bodies, feedback, and errors.

Requests are parsed from raw bytes here (not by FastAPI's body binding) so every failure becomes
an OpenAI-style 4xx that names the offending field::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Validation is strict on types (``"max_tokens": "5"`` is an error, not a silent cast) and on names:
a field that is not a parameter of this API is refused by name, never silently dropped, because a
client that sends ``tools`` or ``logit_bias`` and gets an answer back would believe it was honoured.
OpenAI parameters this API does not implement are listed in ``UNSUPPORTED`` tables with the values
that ask for nothing (``presence_penalty: 0``, ``echo: false``, ``tools: []``), which clients send by
default and which are accepted; any other value is a 400 naming the parameter and saying why.
vLLM's extensions of the API (``min_p``, ``ignore_eos``, ``repetition_penalty``...) are classified
once, in :mod:`serving.vllm_extras`: the implemented ones are fields here, the others join the
``UNSUPPORTED`` tables.

The same models are published as the OpenAPI schema (``GET /openapi.json``, :mod:`serving.openapi`):
request models exactly as validated, response models as the app writes them (the integration and
fuzz tests check real responses against them).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flywheel.contracts import Duration, EpochSeconds, Signal, TokenId
from flywheel.jsonbody import BodyError, load_body
from serving.vllm_extras import RECORDED, Unsupported, unsupported

#: OpenAI's bounds on how many alternatives per token may be asked for.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
INT64 = 2**63

class ApiError(Exception):
    """An error the client caused (or must wait out); rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, type=self.type, code=self.code)


def error_body(
    message: str, param: str | None = None, *, type: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _document_unsupported(schema: dict[str, Any], cls: type) -> None:
    """JSON schema hook: unsupported parameters appear with the only values they accept."""
    props = schema.setdefault("properties", {})
    for name, rule in getattr(cls, "UNSUPPORTED", {}).items():
        props[name] = {"enum": list(rule.accepted),
                       "description": f"Not supported: {rule.reason}. Only these values are accepted."}


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                              json_schema_extra=_document_unsupported)

    #: OpenAI parameters refused unless they ask for nothing (see the module docstring).
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}
    #: How a parameter of this model is named in errors (nested models: ``stream_options.``).
    PARAM_PREFIX: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.UNSUPPORTED:
            return data
        kept = dict(data)
        for name, rule in cls.UNSUPPORTED.items():
            if name in kept and not rule.asks_nothing(kept.pop(name)):
                # not a ValueError: pydantic lets it through as is, with its parameter name
                raise ApiError(400, f"{cls.PARAM_PREFIX}{name} is not supported: {rule.reason}",
                               f"{cls.PARAM_PREFIX}{name}")
        return kept


_TOOLS = "tool and function calling are not implemented"


class StreamOptions(_Req):
    PARAM_PREFIX: ClassVar[str] = "stream_options."
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        "include_obfuscation": Unsupported("stream chunks are never padded", (None, False)),
    }

    include_usage: bool = False
    """Send a last chunk with token usage (and no choices) before ``data: [DONE]``."""


class _Sampling(_Req):
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        "presence_penalty": Unsupported(RECORDED, (None, 0)),
        "frequency_penalty": Unsupported(RECORDED, (None, 0)),
        "logit_bias": Unsupported(RECORDED, (None, {})),
    }
    #: Fields where ``null`` means the default (OpenAI's schema allows it; vLLM's clients send it).
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids")

    model: str = Field(min_length=1)
    """The served model's name, or ``name@vN``."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens to sample at most (the deployment sets an upper bound, ``serve.max_tokens_limit``)."""
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=-1, ge=-1, lt=2**31)
    """Not an OpenAI parameter (vLLM's): sample from the k most likely tokens; -1 or 0 (or any k
    above the vocabulary) for all. Bounded: the engine's request encoding overflows past 64 bits."""
    min_p: float | None = Field(default=0.0, ge=0.0, le=1.0)
    """vLLM's: leave out tokens less likely than ``min_p`` times the most likely one (0: none)."""
    min_tokens: int = Field(default=0, ge=0)
    """vLLM's: EOS and ``stop_token_ids`` cannot be sampled before this many tokens (at most
    ``max_tokens``)."""
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = []
    """vLLM's: sampling stops after any of these tokens (which ends the token ids)."""
    ignore_eos: bool = False
    """vLLM's: go on sampling after EOS, up to ``max_tokens``."""
    include_stop_str_in_output: bool = False
    """vLLM's: keep the stop string that ended the text in it."""
    skip_special_tokens: bool = True
    """vLLM's: leave special tokens (EOS, role markers) out of the text."""
    spaces_between_special_tokens: bool = True
    """vLLM's: put spaces around special tokens in the text (slow tokenizers only)."""
    n: int = Field(default=1, ge=1)
    """Choices to sample; they form one group (GRPO). Bounded by ``serve.max_n``."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    """Up to 4 strings; sampling stops before the first one produced."""
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    """Choice ``i`` of a request samples with ``seed + i``."""
    user: str | None = Field(default=None, max_length=256)
    """The product's id for its end user (pseudonymised before anything is recorded)."""
    safety_identifier: str | None = Field(default=None, max_length=256)
    """OpenAI's newer name for ``user``; either may be sent (the same value if both)."""

    @field_validator(*NULL_IS_DEFAULT, mode="after")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _check_sampling(self) -> _Sampling:
        if self.safety_identifier is not None and self.user not in (None, self.safety_identifier):
            raise ApiError(400, "user and safety_identifier name the same end user: send one, or "
                                "both with the same value", "safety_identifier")
        if "" in self.stops():  # vLLM would stop before the first token
            raise ApiError(400, "stop strings must not be empty", "stop")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def end_user(self) -> str | None:
        return self.user if self.user is not None else self.safety_identifier

    def top_logprobs_n(self) -> int | None:
        """Alternatives per token to return with their logprobs; None: no logprobs at all."""
        raise NotImplementedError


class CompletionRequest(_Sampling):
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        **_Sampling.UNSUPPORTED,
        **unsupported("completions"),
        "echo": Unsupported("echoing the prompt (and its logprobs) is not implemented", (None, False)),
        "suffix": Unsupported("insertion (text after the completion) is not implemented", (None, "")),
    }

    prompt: str | list[int]
    """A string, or token ids (the OpenAI API accepts both; a batch of prompts is not accepted)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """Return each sampled token's logprob and the ``logprobs`` most likely alternatives."""
    best_of: int | None = Field(default=None, ge=1)
    """Accepted only equal to ``n``: choosing the best of more samples server-side is not
    implemented (every sample is returned, and recorded, as a choice)."""
    add_special_tokens: bool = True
    """vLLM's: add the tokenizer's special tokens (BOS) to a text prompt."""

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of={self.best_of} is not supported: only best_of equal to n "
                                f"(here {self.n}); every sample is returned as a choice", "best_of")
        return self

    def top_logprobs_n(self) -> int | None:
        return self.logprobs


class ContentPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        **_Sampling.UNSUPPORTED,
        **unsupported("chat"),
        "response_format": Unsupported("structured output (JSON mode, JSON schema) is not implemented",
                                       (None, {"type": "text"})),
        "tools": Unsupported(_TOOLS, (None, [])),
        "tool_choice": Unsupported(_TOOLS, (None, "none")),
        "parallel_tool_calls": Unsupported(_TOOLS, (None, True)),  # the default of OpenAI and vLLM
        "functions": Unsupported(_TOOLS, (None, [])),
        "function_call": Unsupported(_TOOLS, (None, "none")),
        "modalities": Unsupported("only text is generated", (None, ["text"])),
        "audio": Unsupported("only text is generated"),
        "prediction": Unsupported("predicted outputs are not implemented"),
        "reasoning_effort": Unsupported("reasoning controls are not implemented"),
        "verbosity": Unsupported("verbosity controls are not implemented"),
        "web_search_options": Unsupported("web search is not available"),
        "service_tier": Unsupported("this deployment has one service tier", (None, "auto", "default")),
        "store": Unsupported("stored completions (read back through the API) are not implemented; "
                             "every generation is recorded for training whatever this says", (None, False)),
        "metadata": Unsupported("stored completions are not implemented, so there is nothing to tag",
                                (None, {})),
        "prompt_cache_key": Unsupported("prompt cache controls are not implemented"),
        "prompt_cache_retention": Unsupported("prompt cache controls are not implemented"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """The newer name of ``max_tokens`` in the chat API; either may be sent (this one wins)."""
    logprobs: bool | None = None
    """Return each sampled token's logprob (with ``top_logprobs`` alternatives)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    """Most likely alternatives per token, with their logprobs; needs ``logprobs: true``."""
    add_generation_prompt: bool = True
    """vLLM's: end the prompt with the chat template's opening of the assistant's turn."""
    continue_final_message: bool = False
    """vLLM's: leave the last message open for the model to continue (a prefill); needs
    ``add_generation_prompt: false``."""
    add_special_tokens: bool = False
    """vLLM's: add the tokenizer's special tokens on top of those the chat template writes."""

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing (vLLM's default)
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false (the last "
                                "message is continued, no new turn is opened)", "continue_final_message")
        return self

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class FeedbackRequest(_Req):
    feedback_id: str = Field(min_length=1, max_length=128)
    generation_id: str = Field(min_length=1, max_length=128)
    signal: Signal
    edited_text: str | None = None
    decision_ms: Duration | None = None
    #: When the user acted, if the product knows (epoch seconds); else the time it arrived. A
    #: time after its arrival (a client clock running ahead) is taken as the arrival time.
    created_at: EpochSeconds | None = None
    user: str | None = Field(default=None, max_length=256)
    """The user who judged: the ``user`` the answer was made for, or none (then it is that user's).
    Another user is refused with 409 ``feedback_user_mismatch`` (docs/serving-api.md, Feedback)."""

    @model_validator(mode="after")
    def _edit_has_text(self) -> FeedbackRequest:
        if self.signal == "edit" and self.edited_text is None:
            raise ValueError("signal 'edit' needs edited_text")
        return self


def parse(cls: type[_Req], raw: bytes) -> Any:
    """Bytes -> validated request, or :class:`ApiError` (400) that says what is wrong."""
    try:
        obj = load_body(raw)  # shared with the release API (flywheel/jsonbody.py)
    except BodyError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: list[Any]) -> ApiError:
    """The first few pydantic/FastAPI errors as one message; ``param`` names the first field."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        # drop union-branch names pydantic adds (``str``, ``list[int]``) from the field path
        loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
        name = ".".join(loc) or None
        param = param or name
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = "unknown parameter, not permitted (the parameters this API takes are in /openapi.json)"
        parts.append(f"{name}: {msg}" if name else msg)
    return ApiError(400, "; ".join(parts) or "invalid request", param)


# -- responses (serving -> client) -------------------------------------------------------------
# The app writes these bodies as plain dicts (no per-chunk model building on the streaming path);
# these models are their published schema, and the tests validate real responses against them.
class _Resp(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class ErrorDetail(_Resp):
    message: str
    type: str
    """``invalid_request_error``, ``authentication_error``, ``rate_limit_error`` or ``server_error``."""
    param: str | None = None
    """The request parameter at fault (dotted for nested ones), when one is."""
    code: str | None = None


class ErrorResponse(_Resp):
    error: ErrorDetail


class Usage(_Resp):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort"] | None


class CompletionLogprobs(_Resp):
    """OpenAI's legacy completions shape; one entry per sampled token in each list."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    """The ``logprobs`` most likely tokens, and the sampled one, by token text."""
    text_offset: list[int]
    """Where each token starts in the completion text (characters)."""


class TopLogprob(_Resp):
    token: str
    """The token's text; ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters."""
    logprob: float
    """Log-probability under the distribution sampled from (after temperature, top-p, top-k);
    -9999.0 stands for a token that could not be sampled."""
    bytes: list[int] | None
    """The token's UTF-8 bytes (concatenated in order they give the text back)."""


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Resp):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class _Choice(_Resp):
    index: int
    finish_reason: FinishReason
    """``abort`` when the request was cut short (not an OpenAI value); null until the last chunk."""
    generation_id: str
    """Not an OpenAI field: the id to send feedback on (the response id when ``n`` is 1)."""


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None


class CompletionResponse(_Resp):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    """``name@vN``: the exact model version that answered."""
    choices: list[CompletionChoice]
    usage: Usage | None = None
    """Always in a full response; in a stream only in the last chunk, with ``include_usage``."""


class CompletionChunk(CompletionResponse):
    """One ``data:`` line of a streamed completion (``text`` is the new text only)."""


class AssistantMessage(_Resp):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(_Resp):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Resp):
    role: Literal["assistant"] | None = None
    """Only in a choice's first chunk."""
    content: str


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(_Resp):
    """One ``data:`` line of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Resp):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    version: int | None = None
    """The model version being served; only to a key that sees versions (``serve.version_visible_keys``)."""
    root: str | None = None
    """``name@vN``; only to a key that sees versions."""


class ModelList(_Resp):
    object: Literal["list"]
    data: list[ModelCard]


class FeedbackAccepted(_Resp):
    id: str
    """The ``feedback_id`` sent."""
    object: Literal["feedback"]
    status: Literal["accepted"]
    generation_id: str


class ProbeAnswer(_Resp):
    """``GET /livez`` and ``GET /readyz``: 200 when ok, else 503 with the reason."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    ok: bool
    reason: str | None = None
    """Why not ok (absent when ok): warming up, draining, or an engine is dead."""


class HealthProbe(_Resp):
    """``GET /health`` without a product key: all a probe needs (200 when ok, else 503). The rest
    names hosts, store URIs and errors, and is for key holders."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    ok: bool
    """Every engine is alive."""


class EngineState(_Resp):
    slot: int
    version: int
    in_flight: int
    """Requests running on it."""
    loading: bool
    """Loading a version now (its requests pause)."""


class SignatureState(_Resp):
    """Whether release records are verified (``serve.trusted_release_keys``, docs/signing.md)."""

    verified: bool
    """False: no trusted keys are configured, and any record on the releases topic is followed."""
    trusted_key_ids: list[str]
    key_files_refused: int
    """Key files that cannot be used; their signer's releases are refused. Which files, and why, are
    in serving's log only: ``/health`` answers any product key holder, who has no business with the
    server's paths."""


class ReleaseState(_Resp):
    """The release follower's state (docs/serving-releases.md)."""

    deployment: str
    revision: int | None
    """The release applied; null before the first."""
    routing: Literal["applied", "waiting", "unconfirmed"]
    """``applied``: a release applied; ``waiting``: none yet, not ready for up to
    ``serve.routing_wait_s``; ``unconfirmed``: none after the wait, the model directory served."""
    versions: dict[str, int]
    canary_share: float
    last_apply: dict[str, Any] | None
    last_refusal: dict[str, Any] | None
    last_error: str | None
    signatures: SignatureState


class Health(HealthProbe):
    """``GET /health`` with a product key (or on a deployment without keys)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="allow")

    engine: Literal["ok", "dead"]
    model: str
    """``name@vN`` of the stable route."""
    versions: dict[str, int]
    """The version each route serves."""
    engines: list[EngineState]
    publisher: Literal["ok", "degraded"]
    """``degraded`` while events wait in the local journal for the broker."""
    queue_depth: int
    journal_records: int
    journal_bytes: int
    last_error: str | None
    """The publisher's last error."""
    releases: ReleaseState | None = None
    """Only when serving follows releases."""
