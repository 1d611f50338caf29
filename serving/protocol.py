"""The HTTP wire format: OpenAI-compatible request bodies, the feedback body, and error bodies.

Requests are parsed from raw bytes here (not by FastAPI's body binding) so every failure becomes
an OpenAI-style 4xx that names the offending field::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Validation is strict on types (``"max_tokens": "5"`` is an error, not a silent cast) and lenient
on unknown fields, because OpenAI clients add new optional fields over time.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flywheel.contracts import Duration, EpochSeconds, Signal, may_hold_surrogates


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


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Req):
    include_usage: bool = False


class _Sampling(_Req):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(default=None, max_length=256)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    #: A string, or token ids (the OpenAI API accepts both).
    prompt: str | list[int]


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
    messages: list[ChatMessage] = Field(min_length=1)
    #: The newer name of ``max_tokens`` in the chat API; either may be sent.
    max_completion_tokens: int | None = Field(default=None, ge=1)


class FeedbackRequest(_Req):
    model_config = ConfigDict(extra="forbid", strict=True)

    feedback_id: str = Field(min_length=1, max_length=128)
    generation_id: str = Field(min_length=1, max_length=128)
    signal: Signal
    edited_text: str | None = None
    decision_ms: Duration | None = None
    #: When the user acted, if the product knows (epoch seconds); else the time it arrived. A
    #: time after its arrival (a client clock running ahead) is taken as the arrival time.
    created_at: EpochSeconds | None = None
    user: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _edit_has_text(self) -> FeedbackRequest:
        if self.signal == "edit" and self.edited_text is None:
            raise ValueError("signal 'edit' needs edited_text")
        return self


def parse(cls: type[_Req], raw: bytes) -> Any:
    """Bytes -> validated request, or :class:`ApiError` (400) that says what is wrong."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is JSON nested too deeply to parse") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    if may_hold_surrogates(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                "without its pair): such text cannot be stored as UTF-8") from None
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
        parts.append(f"{name}: {msg}" if name else msg)
    return ApiError(400, "; ".join(parts) or "invalid request", param)
