"""One API request -> n sampled choices -> OpenAI response (or SSE chunks) + one event per choice.

Prompts are turned into token ids here (chat through the tokenizer's chat template with the
generation prompt appended), checked against the context length, and sent to the engine as ids,
so the ``prompt_token_ids`` recorded are exactly what the engine saw.

Choices of one request form a group (GRPO): ``group_id`` is the response id; each choice has its
own ``generation_id`` — the response id itself when ``n == 1`` (so a client can send feedback on
``response.id``), ``<id>-<i>`` otherwise — returned in the choice as an extra field. A response id ends with its
user's owner tag (serving/identity.py ``owned_response_id``), which feedback is checked against.
An answer names its version only to keys that see versions (:meth:`Ctx.answer_model`); the
record always does. Each choice is
its own engine request with its own seed (``seed + i`` when a seed is given), so the samples of a
group are independent.

Logprobs asked for (``logprobs`` / ``top_logprobs``) come back in OpenAI's shapes
(:mod:`serving.logprobs`); the logprob recorded for each token is the same whether or not the
client asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flywheel.contracts import GenerationEvent, SamplingParams, Topics, VersionSpan
from flywheel.logs import GENERATION_ID, REQUEST_ID
from flywheel.settings import ServeSettings
from flywheel.telemetry import Tracing
from serving.engine import Delta, GenRequest, TopLogprobs
from serving.identity import key_id, owned_response_id
from serving.logprobs import LogprobsFormat, Pieces
from serving.protocol import ApiError, ChatRequest, CompletionRequest
from serving.recorder import Recorder
from serving.usage import TokenCounters
from serving.versions import Fleet, Slot

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default


@dataclass
class Ctx:
    """What a request needs from the app: passed down, never global."""

    serve: ServeSettings
    fleet: Fleet
    recorder: Recorder
    topics: Topics
    tokens: TokenCounters
    #: spans, and the headers that carry a request's id and trace onto its records
    tracing: Tracing = field(default_factory=Tracing)
    pieces: Pieces = field(init=False)

    def __post_init__(self) -> None:
        self.pieces = Pieces(self.fleet.tokenizer)

    def model_id(self, version: int) -> str:
        return f"{self.serve.model_name}@v{version}"

    def sees_versions(self, key: str | None) -> bool:
        """Whether ``key`` is told which version answers (``serve.version_visible_keys``). On a
        deployment without keys (``serve.allow_anonymous``, local only) every caller is: it has no
        product users to protect, and no key to tell an operator by."""
        return not self.serve.api_keys or (key is not None and key in self.serve.version_visible_keys)

    def may_pin(self, key: str | None) -> bool:
        """Whether ``key`` may pin a version: one that sees versions, or one in
        ``serve.pin_api_keys``. Any other product key may not: a pinned answer names its version,
        and compared with the same request routed (same ``seed``) it tells a user their canary arm;
        a 404 against a 200 would tell which versions are loaded."""
        return self.sees_versions(key) or (key is not None and key in self.serve.pin_api_keys)

    def answer_model(self, prep: Prepared) -> str:
        """What an answer names as its ``model``: its version to a key that sees versions and to a
        request that pinned one (it named it itself); else the deployment's name alone, canary
        or not, so that no answer tells a user which arm of a canary they are in (a rule that
        hid versions only during a canary would tell by the change itself when one starts)."""
        if prep.route == "pinned" or prep.shows_version:
            return self.model_id(prep.version)
        return self.serve.model_name


@dataclass(frozen=True)
class Prepared:
    endpoint: str  # "completions" | "chat"
    response_id: str
    prompt_text: str
    gen: GenRequest
    n: int
    user_id: str
    created_at: float
    #: Alternatives per token to return with the logprobs; None: no logprobs in the response.
    top_logprobs: int | None = None
    #: The engine slot the request runs on, the route that chose it, and the version it held then
    #: (what the response names and the events record as ``model_version``).
    slot: Slot | None = None
    route: str = "stable"
    version: int = 0
    #: The id of the API key that asked (serving/identity.py ``key_id``); None without keys.
    api_key_id: str | None = None
    #: The answer names its version (``serve.version_visible_keys``: :meth:`Ctx.answer_model`).
    shows_version: bool = False

    def generation_id(self, i: int) -> str:
        return self.response_id if self.n == 1 else f"{self.response_id}-{i}"

    def request_for(self, i: int) -> GenRequest:
        if self.gen.seed is None or i == 0:
            return self.gen
        return dataclasses.replace(self.gen, seed=self.gen.seed + i)


@dataclass
class Choice:
    index: int
    generation_id: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: TopLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    versions: list[tuple[int, int, int]] = field(default_factory=list)


# -- preparing ---------------------------------------------------------------------------------
def pinned_version(ctx: Ctx, model: str) -> int | None:
    """None for the deployment's name (routed by user), N for ``<name>@vN`` (pinned)."""
    name = ctx.serve.model_name
    if model == name:
        return None
    tag = model[len(name) + 1:] if model.startswith(f"{name}@") else None
    if tag is None or not (tag[:1] == "v" and tag[1:].isdigit() and len(tag) < 20):
        raise ApiError(404, f"model {model!r} does not exist; this deployment serves {name!r} "
                       f"(or {name}@v<version> for a version it has loaded)", "model", code="model_not_found")
    return int(tag[1:])


def route(ctx: Ctx, model: str, user_id: str, key: str | None) -> tuple[Slot, str, int]:
    """The slot, route and version a request runs on: pinned by ``model``, else by the user."""
    pinned = pinned_version(ctx, model)
    if pinned is not None and not ctx.may_pin(key):
        raise ApiError(403, f"this API key may not pin a version; ask for {ctx.serve.model_name!r}",
                       "model", type="permission_error", code="pin_not_allowed")
    try:
        slot, how = ctx.fleet.pick(user_id, pinned)
    except LookupError:
        loaded = ", ".join(f"{ctx.model_id(v)} ({r})" for r, v in ctx.fleet.served_versions().items())
        # which versions run, and whether a canary does, only to a key that sees versions
        serves = f"; this deployment serves {loaded}" if ctx.sees_versions(key) else ""
        raise ApiError(404, f"version {pinned} is not loaded{serves}", "model",
                       code="model_not_found") from None
    return slot, how, slot.version


def _limits(ctx: Ctx, n: int, max_tokens: int, n_prompt: int) -> None:
    s = ctx.serve
    if n > s.max_n:
        raise ApiError(400, f"n={n} is above this deployment's limit of {s.max_n}", "n")
    if max_tokens > s.max_tokens_limit:
        raise ApiError(400, f"max_tokens={max_tokens} is above the limit of {s.max_tokens_limit}",
                       "max_tokens")
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty", "prompt")
    limit = ctx.fleet.max_model_len
    if n_prompt + max_tokens > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                       f"{n_prompt} tokens and max_tokens asks for {max_tokens} more "
                       f"({n_prompt + max_tokens} in all): shorten the prompt or lower max_tokens",
                       "max_tokens" if n_prompt < limit else "prompt", code="context_length_exceeded")


def _check_extras(ctx: Ctx, body: CompletionRequest | ChatRequest, max_tokens: int) -> None:
    """vLLM's extras that depend on this request's or this model's other numbers."""
    if body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens={body.min_tokens} is above max_tokens={max_tokens}", "min_tokens")
    vocab = len(ctx.fleet.tokenizer)
    if any(t >= vocab for t in body.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")


def gen_request(ids: list[int], body: CompletionRequest | ChatRequest, max_tokens: int) -> GenRequest:
    """The engine request for a parsed body (null sampling values are their defaults by now)."""
    return GenRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stops(),
                      top_logprobs=body.top_logprobs_n() or 0, min_p=body.min_p, min_tokens=body.min_tokens,
                      stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                      include_stop_str_in_output=body.include_stop_str_in_output,
                      skip_special_tokens=body.skip_special_tokens,
                      spaces_between_special_tokens=body.spaces_between_special_tokens)


def prepare_completion(ctx: Ctx, body: CompletionRequest, user_id: str) -> Prepared:
    """The prompt tokenized and checked; slow for a long prompt, so the app runs it off the event
    loop, then :func:`routed` on it."""
    pinned_version(ctx, body.model)  # an unknown model is refused before the prompt is read
    tok = ctx.fleet.tokenizer
    if isinstance(body.prompt, str):
        text, ids = body.prompt, tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        vocab = len(tok)
        if any(t < 0 or t >= vocab for t in body.prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        text, ids = tok.decode(body.prompt), list(body.prompt)
    # a deployment limit below OpenAI's default must not refuse requests that leave it out
    max_tokens = body.max_tokens or min(COMPLETION_DEFAULT_MAX_TOKENS, ctx.serve.max_tokens_limit)
    _limits(ctx, body.n, max_tokens, len(ids))
    _check_extras(ctx, body, max_tokens)
    return Prepared("completions", _response_id(ctx, "cmpl", user_id), text, gen_request(ids, body, max_tokens),
                    body.n, user_id, time.time(), body.top_logprobs_n())


def prepare_chat(ctx: Ctx, body: ChatRequest, user_id: str) -> Prepared:
    """As :func:`prepare_completion`, through the chat template."""
    pinned_version(ctx, body.model)
    tok = ctx.fleet.tokenizer
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    text = _chat_prompt(tok, messages, body)
    # the template writes the BOS itself: special tokens are added again only if asked (vLLM's rule)
    ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
    room = ctx.fleet.max_model_len - len(ids)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested or max(1, min(ctx.serve.max_tokens_limit, room))
    _limits(ctx, body.n, max_tokens, len(ids))
    _check_extras(ctx, body, max_tokens)
    return Prepared("chat", _response_id(ctx, "chatcmpl", user_id), text, gen_request(ids, body, max_tokens),
                    body.n, user_id, time.time(), body.top_logprobs_n())


def _response_id(ctx: Ctx, prefix: str, user_id: str) -> str:
    """A fresh response id that carries its user's owner tag: feedback on it is checked against
    the user it names (serving/identity.py ``owner_of``, docs/serving-api.md "Feedback")."""
    return owned_response_id(ctx.serve.user_id_salt, f"{prefix}-{uuid.uuid4().hex}", user_id)


def routed(ctx: Ctx, prep: Prepared, model: str, key: str | None) -> Prepared:
    """``prep`` on the slot its pinned version or its user is routed to. On the event loop, where
    the fleet's routing changes, and as late as possible: a slot picked before a long tokenization
    could be loading another version by the time the request reaches it."""
    slot, how, version = route(ctx, model, prep.user_id, key)
    # a deployment without keys takes any bearer string: accounting it would name arbitrary keys
    api_key_id = key_id(ctx.serve.user_id_salt, key) if ctx.serve.api_keys else None
    return dataclasses.replace(prep, slot=slot, route=how, version=version, api_key_id=api_key_id,
                               shows_version=ctx.sees_versions(key))


def _chat_prompt(tok: Any, messages: list[dict[str, str]], body: ChatRequest) -> str:
    if not tok.chat_template:
        # a base model imported without one (`flywheel model import` warns): no format to guess
        raise ApiError(400, "this model has no chat template: send the prompt in the model's own format to "
                            "/v1/completions", "messages")
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                       continue_final_message=body.continue_final_message)
    except ValueError as exc:  # transformers: the last message is not found in what the template wrote
        if not body.continue_final_message:
            raise
        raise ApiError(400, f"continue_final_message: this model's chat template cannot leave the last "
                            f"message open ({exc})", "continue_final_message") from None


# -- running and recording ---------------------------------------------------------------------
async def run_choice(ctx: Ctx, prep: Prepared, i: int, sink: asyncio.Queue | None = None) -> Choice:
    """Drive one engine request to its end; record it (also when cancelled: ``abort``).

    With a ``sink`` (streaming) every delta is forwarded as it comes; without one the engine
    returns the finished sequence in one piece.
    """
    choice = Choice(i, prep.generation_id(i))
    # (each choice runs in a task of its own, with a copy of the request's context)
    GENERATION_ID.set(choice.generation_id)
    slot = prep.slot
    assert slot is not None  # set by routed()
    slot.in_flight += 1
    try:
        if sink is None:
            _add(choice, await slot.engine.complete(prep.request_for(i), choice.generation_id))
        else:
            async for d in slot.engine.stream(prep.request_for(i), choice.generation_id):
                _add(choice, d)
                await sink.put((i, d))
    except asyncio.CancelledError:
        choice.finish_reason = "abort"
        raise
    finally:
        slot.in_flight -= 1
        record(ctx, prep, choice)
    return choice


def _add(choice: Choice, d: Delta) -> None:
    choice.token_ids += d.token_ids
    choice.text.append(d.text)
    choice.logprobs += d.logprobs
    choice.top += d.top
    choice.finish_reason = d.finish_reason or choice.finish_reason
    choice.versions = d.versions or choice.versions


def record(ctx: Ctx, prep: Prepared, c: Choice) -> None:
    done = time.time()
    g = prep.gen
    try:
        event = GenerationEvent(
            generation_id=c.generation_id, group_id=prep.response_id, choice_index=c.index,
            model_name=ctx.serve.model_name, model_version=prep.version, route=prep.route,
            version_spans=_spans(prep.version, c.versions),
            user_id=prep.user_id, endpoint=prep.endpoint, created_at=prep.created_at,
            completed_at=max(done, prep.created_at), latency_ms=max(0.0, (done - prep.created_at) * 1e3),
            prompt_text=prep.prompt_text, prompt_token_ids=tuple(g.prompt_token_ids),
            completion_text="".join(c.text), completion_token_ids=tuple(c.token_ids),
            logprobs=tuple(c.logprobs),
            sampling=sampling_record(g, prep.request_for(c.index).seed, ctx.fleet.logprobs_mode),
            finish_reason=c.finish_reason or "abort", api_key_id=prep.api_key_id,
        )
    except ValidationError as exc:  # an engine output we cannot vouch for is not training data
        log.error("generation %s not recorded: %s", c.generation_id, exc)
        ctx.recorder.metrics.dropped.labels("generation", "invalid").inc()
        return
    ctx.tokens.count(event)
    ctx.recorder.record_generation(ctx.topics.generations, event,
                                   ctx.tracing.record_headers("generation", REQUEST_ID.get()))


def sampling_record(g: GenRequest, seed: int | None, logprobs_mode: str) -> SamplingParams:
    """What the trainer needs to know of how a choice was sampled (``seed``: the choice's own)."""
    return SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_tokens=g.max_tokens,
                          seed=seed, stop=g.stop, logprobs_mode=logprobs_mode, min_p=g.min_p,
                          min_tokens=g.min_tokens, stop_token_ids=g.stop_token_ids, ignore_eos=g.ignore_eos,
                          include_stop_str_in_output=g.include_stop_str_in_output,
                          skip_special_tokens=g.skip_special_tokens,
                          spaces_between_special_tokens=g.spaces_between_special_tokens)


def _spans(version: int, spans: list[tuple[int, int, int]]) -> tuple[VersionSpan, ...]:
    """vLLM's spans, kept only when some token came from another version than ``version``."""
    if all(v == version for v, _, _ in spans):
        return ()
    return tuple(VersionSpan(version=v, start=a, end=b) for v, a, b in spans)


async def run_all(ctx: Ctx, prep: Prepared) -> list[Choice]:
    return list(await asyncio.gather(*(run_choice(ctx, prep, i) for i in range(prep.n))))


# -- response bodies ---------------------------------------------------------------------------
def _usage(prep: Prepared, choices: list[Choice]) -> dict[str, int]:
    p = len(prep.gen.prompt_token_ids)
    c = sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def response_body(ctx: Ctx, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
    chat = prep.endpoint == "chat"
    out = []
    for c in choices:
        logprobs = None
        if prep.top_logprobs is not None:
            logprobs = LogprobsFormat(ctx.pieces, chat).of(c.token_ids, c.logprobs, c.top)
        item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                "logprobs": logprobs, "generation_id": c.generation_id}
        if chat:
            item["message"] = {"role": "assistant", "content": "".join(c.text)}
        else:
            item["text"] = "".join(c.text)
        out.append(item)
    return {"id": prep.response_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(prep.created_at), "model": ctx.answer_model(prep), "choices": out,
            "usage": _usage(prep, choices)}


def _chunk(ctx: Ctx, prep: Prepared, choice: dict[str, Any], usage: Any = None) -> bytes:
    chat = prep.endpoint == "chat"
    body = {"id": prep.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(prep.created_at), "model": ctx.answer_model(prep),
            "choices": [choice] if choice else []}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def stream_sse(ctx: Ctx, prep: Prepared, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks as the choices' deltas arrive, interleaved; ends with ``data: [DONE]``."""
    chat = prep.endpoint == "chat"
    sink: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(run_choice(ctx, prep, i, sink)) for i in range(prep.n)]
    waiter = asyncio.ensure_future(asyncio.gather(*tasks))
    started: set[int] = set()
    formats = [LogprobsFormat(ctx.pieces, chat) for _ in range(prep.n)]  # offsets run per choice
    getter: asyncio.Future | None = None
    try:
        while not (waiter.done() and sink.empty()):
            getter = asyncio.ensure_future(sink.get())
            await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            i, d = getter.result()
            logprobs = None if prep.top_logprobs is None else formats[i].of(d.token_ids, d.logprobs, d.top)
            item: dict[str, Any] = {"index": i, "finish_reason": d.finish_reason, "logprobs": logprobs,
                                    "generation_id": prep.generation_id(i)}
            if chat:
                item["delta"] = {"content": d.text} if i in started else {"role": "assistant", "content": d.text}
            else:
                item["text"] = d.text
            started.add(i)
            yield _chunk(ctx, prep, item)
        choices = waiter.result()  # re-raises an engine error
        if include_usage:
            yield _chunk(ctx, prep, {}, _usage(prep, choices))
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): stop every engine request
        for t in (*tasks, waiter, getter):
            if t is not None:
                t.cancel()
