"""The generation engine behind a small interface, so the API does not depend on vLLM internals.

:class:`Engine` is what the app needs: a tokenizer (chat template + encoding), the context
length, the served model version, and ``stream`` — an async iterator of :class:`Delta` per
sampled sequence, each carrying the new token ids, their text and the sampler's logprob of each
token. :class:`VllmEngine` implements it over vLLM's ``AsyncLLM`` (CPU build or official GPU
build alike: nothing here is CPU-only).

Logprobs: vLLM is started with ``logprobs_mode="processed_logprobs"`` and every request asks
``logprobs=N`` with N = 0 (only the sampled token) unless the client asked for alternatives, so
each recorded logprob is log p(token) under the distribution the token was actually drawn from,
after temperature / top-p / top-k / min-p (and min_tokens' mask of the stop tokens). That is the
behaviour policy the trainer's importance-sampling correction needs; raw logprobs would be the
model's untempered distribution instead. Asking for
N alternatives changes nothing sampled or recorded: vLLM reports the sampled token's logprob
first and the top N from the same processed distribution beside it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from flywheel.checkpoints import manifest
from flywheel.extras import require_vllm
from flywheel.settings import ServeSettings
from serving.engine_stats import EngineStats, stat_logger
from serving.tether import tether_engines


@dataclass(frozen=True)
class GenRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: Alternatives per token to report with their logprobs (the API's ``top_logprobs``).
    top_logprobs: int = 0
    # vLLM's extras this API implements (serving/vllm_extras.py), recorded with the generation
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def engine_text(self) -> bool:
        """Whether the text must be vLLM's own detokenization: stops are matched (and cut) on its
        text, and decoding options other than the plain ones are its to apply."""
        return bool(self.stop or self.stop_token_ids or self.include_stop_str_in_output
                    or not self.skip_special_tokens or not self.spaces_between_special_tokens)


#: Per sampled token, the most likely tokens as (token id, logprob), most likely first.
TopLogprobs = list[list[tuple[int, float]]]


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    #: ``stop`` / ``length`` / ``abort`` on the last delta of a sequence, else None.
    finish_reason: str | None
    #: Filled only when the request asked for ``top_logprobs > 0``.
    top: TopLogprobs = field(default_factory=list)
    #: On a sequence's last delta: ``(version, start, end)`` spans of the versions that sampled
    #: its tokens, as vLLM reports them (two or more when a weight swap landed mid-request).
    versions: list[tuple[int, int, int]] = field(default_factory=list)


class Engine(Protocol):
    tokenizer: Any
    max_model_len: int
    model_version: int
    #: ``processed`` or ``raw`` (see the module docstring), recorded with every generation.
    logprobs_mode: str

    def stream(self, req: GenRequest, request_id: str) -> AsyncIterator[Delta]: ...

    async def complete(self, req: GenRequest, request_id: str) -> Delta:
        """The whole sequence as one :class:`Delta` (no per-token wake-ups)."""
        ...

    def healthy(self) -> bool: ...

    async def reload(self, model_dir: Path, version: int) -> float:
        """Load verified weights from ``model_dir`` as ``version`` without failing a request;
        the seconds requests were paused."""
        ...

    def shutdown(self) -> None: ...


def configure_vllm_env(serve: ServeSettings) -> None:
    """vLLM reads its CPU placement from the environment when it starts its engine process.

    Set here, from settings parsed at the entrypoint, before vLLM is imported; the variables are
    ignored by the GPU build. ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB.
    """
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(serve.vllm_kv_cache_gib)))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = serve.cpu_threads_bind
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_args(serve: ServeSettings, model_dir: Path, lora: bool = False) -> Any:
    """vLLM's engine arguments for ``model_dir`` under ``serve`` (call :func:`configure_vllm_env` first);
    ``lora``: the one engine that serves adapter versions on its weights (serving/adapters.py)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    lora_args: dict[str, Any] = {}
    if lora:
        # max_cpu_loras (vLLM's cache of loaded adapters) defaults to max_loras: an adapter added
        # beyond it evicts the least recently used one, which a request still running on it would
        # load again from a directory serving may have pruned
        lora_args = {"enable_lora": True, "max_loras": serve.max_loras, "max_lora_rank": serve.max_lora_rank}
    return AsyncEngineArgs(
        **lora_args,
        model=str(model_dir),
        dtype=serve.dtype,
        max_model_len=serve.max_model_len,
        max_num_seqs=serve.max_num_seqs,
        enforce_eager=serve.enforce_eager,
        # the share of the GPU this process may take, split between its engines (stable and
        # canary): each engine reserves its part at start
        gpu_memory_utilization=serve.gpu_memory_utilization / (1 if lora else serve.engines),
        logprobs_mode="processed_logprobs",
        # vLLM's periodic log line stays off; its statistics reach /metrics through the stat
        # logger VllmEngine passes (serving/engine_stats.py), which turns their collection on
        disable_log_stats=True,
        # imported in each worker process before it runs the model (see the module)
        worker_extension_cls="serving.vllm_worker.WorkerSetup",
    )


class ModelRefused(ValueError):
    """A model directory serving could not load, and why (:func:`check_model_dir`)."""


def check_model_dir(serve: ServeSettings, model_dir: Path) -> None:
    """What serving does with ``model_dir`` before its engine reads a weight, without starting one
    (seconds, where an engine start is half a minute and the model's memory).

    The tokenizer is loaded and its chat template renders a conversation, as the chat API does;
    vLLM resolves its model config from the same engine arguments :class:`VllmEngine` passes: the
    architecture must be one vLLM implements, the context length must fit ``serve.max_model_len``,
    the dtype must be one it runs. The weights themselves are checked by the trainer's check
    (names and shapes) and by the manifest's hashes. Raises :class:`ModelRefused`.
    """
    # vLLM missing is the install's fault, not the model's: MissingExtra, not ModelRefused
    require_vllm()
    configure_vllm_env(serve)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - any loader failure is the answer
        raise ModelRefused(f"its tokenizer does not load: {_first_line(exc)}") from None
    if tok.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        try:
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template can raise anything it likes
            raise ModelRefused(f"its chat template does not render a conversation: {_first_line(exc)}") from None
    try:
        engine_args(serve, model_dir).create_model_config()
    except Exception as exc:  # noqa: BLE001 - vLLM raises pydantic, value and OS errors alike
        raise ModelRefused(f"vLLM does not accept it: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    """An exception's gist: vLLM's refusal of an architecture lists all 400 it knows."""
    text = str(exc).strip()
    for line in text.splitlines():
        if "Value error, " in line:  # pydantic wraps the validator's message
            text = line.split("Value error, ", 1)[1]
            break
    text = text.split(" Supported architectures:")[0]
    return text[:500]


class VllmEngine:
    """:class:`Engine` over ``vllm.v1.engine.async_llm.AsyncLLM``.

    Create it inside the event loop that will serve requests (``AsyncLLM`` binds its output
    handler to the running loop on first use).
    """

    def __init__(self, serve: ServeSettings, model_dir: Path, lora: bool = False) -> None:
        configure_vllm_env(serve)
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        tether_engines()  # the engine's processes die with this one, however it dies
        model_dir = Path(model_dir)
        self.model_version = int(manifest.read(model_dir)["version"])
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.logprobs_mode = "processed"
        #: vLLM's statistics of this engine by version, or None with ``serve.engine_stats`` off
        self.stats = EngineStats(lambda: self.model_version) if serve.engine_stats else None
        loggers = [stat_logger(self.stats)] if self.stats is not None else None
        self._llm = AsyncLLM.from_engine_args(engine_args(serve, model_dir, lora), stat_loggers=loggers)
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self._version_labelled = False

    async def _label(self) -> None:
        # vLLM tags every step's output with this label and reports spans of it per request
        if not self._version_labelled:
            await self._llm.update_weight_version(str(self.model_version))
            self._version_labelled = True

    async def reload(self, model_dir: Path, version: int) -> float:
        """Pause (``keep``: running requests stay where they are; ``clear_cache``: their KV is
        recomputed under the new weights, so every later token is the new version's alone),
        reload the safetensors in ``model_dir``, relabel, resume. ``model_dir`` must already be
        verified: vLLM loads whatever it finds there and only warns about missing tensors."""
        import time

        await self._label()
        t0 = time.perf_counter()
        await self._llm.pause_generation(mode="keep", clear_cache=True)
        try:
            # vLLM's reload_weights, tying a tied output head again (serving/vllm_worker.py)
            await self._llm.collective_rpc("reload_weights_tied", kwargs={"weights_path": str(model_dir)})
            await self._llm.update_weight_version(str(version))
            self.model_version = version
        finally:
            await self._llm.resume_generation()
        return time.perf_counter() - t0

    async def stream(self, req: GenRequest, request_id: str, lora: Any = None) -> AsyncIterator[Delta]:
        """``lora``: the ``LoRARequest`` of the adapter to run with (an engine started with ``lora``)."""
        await self._label()
        prompt = {"prompt_token_ids": list(req.prompt_token_ids)}
        async for out in self._llm.generate(prompt, vllm_params(req), request_id, lora_request=lora):
            yield _delta(out, req.top_logprobs)

    async def complete(self, req: GenRequest, request_id: str, lora: Any = None) -> Delta:
        await self._label()
        prompt = {"prompt_token_ids": list(req.prompt_token_ids)}
        last = None
        async for out in self._llm.generate(prompt, vllm_params(req, final_only=True), request_id,
                                            lora_request=lora):
            last = out
        if last is None:
            raise RuntimeError(f"engine returned nothing for {request_id}")
        delta = _delta(last, req.top_logprobs)
        if req.engine_text():  # vLLM detokenized; its text is authoritative
            return delta
        text = self.tokenizer.decode(delta.token_ids, skip_special_tokens=True)
        return replace(delta, text=text)

    async def add_adapter(self, lora: Any) -> None:
        """Load the adapter of ``lora`` (a ``LoRARequest``) into the running engine; requests that
        name it from then on run with it. Nothing running pauses."""
        if not await self._llm.add_lora(lora):
            raise RuntimeError(f"vLLM did not load adapter {lora.lora_name} ({lora.lora_path})")

    async def remove_adapter(self, lora_id: int) -> None:
        await self._llm.remove_lora(lora_id)

    def healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            # drop it now: AsyncLLM's finaliser calls shutdown again, which fails noisily if it
            # only runs at interpreter exit, after the modules it needs are gone
            self._llm = None


def vllm_params(req: GenRequest, final_only: bool = False) -> Any:
    """vLLM's ``SamplingParams`` for one sequence of ``req``.

    Unless the text must be vLLM's (:meth:`GenRequest.engine_text`), a non-streamed sequence is
    decoded once by :meth:`VllmEngine.complete`, so vLLM's output processor skips detokenizing every
    step and every logprob entry: about a third of the API process's CPU per token on small models.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(0, req.top_k),
        min_p=req.min_p,
        seed=req.seed,
        stop=list(req.stop) or None,
        stop_token_ids=list(req.stop_token_ids) or None,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logprobs=req.top_logprobs,  # the sampled token's own logprob, and the top N
        detokenize=not final_only or req.engine_text(),
        # streamed requests take each step's new tokens; others only the finished sequence,
        # which saves the API one task wake-up per token
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
    )


def _delta(out: Any, n_top: int) -> Delta:
    o = out.outputs[0]
    ids = list(o.token_ids)
    steps = o.logprobs or []
    # each step's dict holds the sampled token (and, with n_top > 0, the top n_top beside it)
    lps = [float(step[t].logprob) for t, step in zip(ids, steps)]
    top = [_top(step, n_top) for step in steps] if n_top else []
    return Delta(ids, o.text, lps, _finish(o.finish_reason) if out.finished else None, top,
                 _spans(getattr(o, "weight_versions", None)))


def _spans(spans: Any) -> list[tuple[int, int, int]]:
    """vLLM's weight-version spans as ints; empty when it reported none or a label is not ours."""
    try:
        return [(int(s.version), int(s.start), int(s.end)) for s in spans or ()]
    except (TypeError, ValueError):
        return []


def _top(step: dict[int, Any], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of one step, most likely first.

    vLLM inserts the sampled token first (with its own rank), then the top ``n`` with ranks
    1..n. A sampled token among those is one key, so the dict has ``n`` entries; otherwise it
    has ``n + 1`` and the first is not one of the top ``n`` (even when a tie gives it a rank
    that is).
    """
    items = list(step.items())
    if len(items) > n:
        items = items[1:]
    items.sort(key=lambda kv: kv[1].rank)
    return [(tid, float(lp.logprob)) for tid, lp in items[:n]]


def _finish(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "abort"
