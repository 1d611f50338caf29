"""vLLM's extra request parameters, and how this API treats each: one table, :data:`VLLM_EXTRAS`.

Applications written for ``vllm serve`` (and vLLM's own benchmark client, ``vllm bench serve``)
send vLLM's documented extensions of the OpenAI API, mostly at their neutral values
(``repetition_penalty: 1.0``, ``skip_special_tokens: true``) and some on purpose
(``ignore_eos: true`` from the benchmark's random prompts). The table is vLLM 0.32's request models
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``); each parameter is either

* :class:`Implemented`: a parameter of the request models, honoured, and carried by the recorded
  generation, either in its ``sampling`` (a :class:`flywheel.contracts.SamplingParams` field of the
  same name) or in the prompt token ids it shaped; or
* :class:`Unsupported`: accepted at the values that ask for nothing, any other value refused with
  a 400 that names it and says why. Three reasons recur: it reshapes the distribution tokens are
  drawn from in a way the recorded generation cannot carry (``RECORDED``: the trainer recomputes
  logprobs from the recorded sampling parameters, the rule ``presence_penalty`` has always had);
  it constrains sampling by a grammar (``GRAMMAR``); or it is an output or serving feature this API
  does not have.

The line between the two for sampling: parameters that decide when sampling stops or how tokens
become text (``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``skip_special_tokens``...) leave
the distribution of each token alone, and truncations of it (``min_p``, like ``top_p`` and
``top_k``) only cut tokens off and renormalise the rest; both are fully described by a few recorded
numbers. Penalties, biases and masks that depend on the sequence so far or on lists a record does
not hold are refused. ``tests/unit/test_serving_vllm_extras.py`` checks every field of vLLM's
request models against this table; docs/serving-api.md shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
BOTH: tuple[Endpoint, ...] = ("completions", "chat")


@dataclass(frozen=True)
class Unsupported:
    """A parameter this API does not implement.

    ``accepted`` are the values that ask for nothing (what clients send by default); they are
    accepted and mean what they say. Any other value is refused with ``reason``.
    """

    reason: str
    accepted: tuple[Any, ...] = (None,)

    def asks_nothing(self, value: Any) -> bool:
        # 0 and 0.0 are the same number, but False is not 0 and "0" is not 0
        return any(value == a and _kind(value) == _kind(a) for a in self.accepted)


def _kind(v: Any) -> str:
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


@dataclass(frozen=True)
class Implemented:
    """A vLLM parameter this API honours; ``carried_by`` says where the recorded generation keeps
    its effect: ``sampling`` (the SamplingParams field of the same name) or ``prompt`` (the
    recorded prompt token ids are the ones it shaped)."""

    why: str
    carried_by: Literal["sampling", "prompt"] = "sampling"


@dataclass(frozen=True)
class VllmExtra:
    rule: Implemented | Unsupported
    endpoints: tuple[Endpoint, ...] = BOTH


RECORDED = ("it changes the sampling distribution in a way a recorded generation cannot carry "
            "(the trainer recomputes logprobs from the recorded sampling parameters)")
GRAMMAR = ("structured output is not implemented: its grammar masks tokens as sampling goes, which "
           "a recorded generation cannot carry")
_REMOVED = "vLLM removed it (and ignores it since); " + GRAMMAR
_BEAMS = "beam search is not implemented: it returns the likeliest of several sequences, not a sample"
_TRUNCATE = ("prompt truncation is not implemented: a prompt longer than the context is a 400 that "
             "says by how much")
_RENDER = "it concerns vLLM's render endpoints, which this API does not have"
_TEXT_ONLY = "only text is accepted"

#: Every extra parameter of vLLM's completions and chat requests, by name. (The OpenAI parameters
#: both APIs share are the request models' own, and their ``UNSUPPORTED`` tables.)
VLLM_EXTRAS: dict[str, VllmExtra] = {
    # -- sampling: implemented, recorded in the generation's SamplingParams --------------------
    # truncations: tokens below the cut get probability 0 and the rest are renormalised; the
    # recorded logprobs are of that distribution (vLLM's processed logprobs), like top_p's
    "top_k": VllmExtra(Implemented("a truncation to the k most likely tokens")),
    "min_p": VllmExtra(Implemented("a truncation below min_p times the most likely token's probability")),
    # when sampling stops: the distribution of each token is unchanged, except that min_tokens
    # masks the stop tokens (EOS and stop_token_ids) until that many were sampled, a truncation
    "min_tokens": VllmExtra(Implemented("stop tokens cannot be sampled before this many tokens")),
    "stop_token_ids": VllmExtra(Implemented("sampling stops after one of these tokens")),
    "ignore_eos": VllmExtra(Implemented("sampling goes on past EOS (the benchmark's random prompts ask for it)")),
    # how tokens become text: the recorded token ids are the same whatever these say
    "include_stop_str_in_output": VllmExtra(Implemented("the text keeps the stop string that ended it")),
    "skip_special_tokens": VllmExtra(Implemented("special tokens are left out of the text")),
    "spaces_between_special_tokens": VllmExtra(Implemented("spaces around special tokens in the text")),
    # -- the prompt: implemented, carried by the recorded prompt token ids ---------------------
    "add_special_tokens": VllmExtra(Implemented("BOS and the like added when tokenizing the prompt", "prompt")),
    "add_generation_prompt": VllmExtra(Implemented("the assistant's turn opened by the chat template", "prompt"),
                                       ("chat",)),
    "continue_final_message": VllmExtra(Implemented("the last message left open, for the model to continue",
                                                    "prompt"), ("chat",)),
    # -- sampling: refused unless neutral ------------------------------------------------------
    # these reshape the distribution by the sequence so far, a key or a list the record lacks
    "repetition_penalty": VllmExtra(Unsupported(RECORDED, (None, 1))),
    "watermarking": VllmExtra(Unsupported(RECORDED, (None, False))),
    "allowed_token_ids": VllmExtra(Unsupported(RECORDED)),
    "bad_words": VllmExtra(Unsupported(RECORDED, (None, []))),
    "structured_outputs": VllmExtra(Unsupported(GRAMMAR)),
    "response_format": VllmExtra(Unsupported(GRAMMAR, (None, {"type": "text"})), ("completions",)),
    **{name: VllmExtra(Unsupported(_REMOVED)) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern")},
    # beam search keeps the likeliest beams: what it returns is no sample of the policy
    "use_beam_search": VllmExtra(Unsupported(_BEAMS, (None, False))),
    "length_penalty": VllmExtra(Unsupported(_BEAMS, (None, 1))),
    "repetition_detection": VllmExtra(Unsupported("repetition detection is not implemented")),
    "thinking_token_budget": VllmExtra(Unsupported("reasoning controls are not implemented", (None, -1))),
    # -- the prompt: refused unless neutral ----------------------------------------------------
    "truncate_prompt_tokens": VllmExtra(Unsupported(_TRUNCATE)),
    "truncation_side": VllmExtra(Unsupported(_TRUNCATE)),
    "prompt_embeds": VllmExtra(Unsupported("prompts are text or token ids"), ("completions",)),
    "echo": VllmExtra(Unsupported("echoing the last message is not implemented", (None, False)), ("chat",)),
    # a template could ignore them silently: retrieved text belongs in the messages
    "documents": VllmExtra(Unsupported("documents are not passed to the chat template: put them in the "
                                       "messages", (None, [])), ("chat",)),
    # vLLM itself refuses a request's template unless started with --trust-request-chat-template
    "chat_template": VllmExtra(Unsupported("a request's own chat template is not trusted"), ("chat",)),
    "chat_template_kwargs": VllmExtra(Unsupported("per-request chat template variables are not implemented",
                                                  (None, {})), ("chat",)),
    "media_io_kwargs": VllmExtra(Unsupported(_TEXT_ONLY, (None, {})), ("chat",)),
    "mm_processor_kwargs": VllmExtra(Unsupported(_TEXT_ONLY, (None, {})), ("chat",)),
    # -- what the response holds: refused unless neutral ---------------------------------------
    "prompt_logprobs": VllmExtra(Unsupported("prompt logprobs are not returned")),
    "logprob_token_ids": VllmExtra(Unsupported("logprobs of chosen token ids are not returned (top_logprobs "
                                               "are)", (None, []))),
    "return_tokens_as_token_ids": VllmExtra(Unsupported("tokens are returned as text and bytes", (None, False))),
    "return_token_ids": VllmExtra(Unsupported("token ids are not returned", (None, False))),
    "return_prompt_text": VllmExtra(Unsupported("the prompt text is not returned", (None, False)), ("chat",)),
    "include_reasoning": VllmExtra(Unsupported("reasoning is not told apart from the answer", (None, True)),
                                   ("chat",)),
    "routed_experts_prompt_start": VllmExtra(Unsupported("routed-expert data is not returned", (None, 0))),
    "return_token_offsets": VllmExtra(Unsupported(_RENDER, (None, False))),
    "mm_payload": VllmExtra(Unsupported(_RENDER, (None, "tensors"))),
    "return_mm_kwargs": VllmExtra(Unsupported(_RENDER, (None, True))),
    # -- serving machinery: refused unless neutral ---------------------------------------------
    # the response id is the key feedback is sent on (and the generation's id): the server's
    "request_id": VllmExtra(Unsupported("the server names each request (its response id is the id to "
                                        "send feedback on)")),
    "session_id": VllmExtra(Unsupported("sessions are not implemented (requests are routed by user)")),
    "priority": VllmExtra(Unsupported("this deployment has no priority scheduling", (None, 0))),
    "stream_interval": VllmExtra(Unsupported("each streamed chunk carries one engine step's tokens", (None, 1))),
    "cache_salt": VllmExtra(Unsupported("prefix-cache salting is not implemented")),
    "kv_transfer_params": VllmExtra(Unsupported("disaggregated serving is not used", (None, {}))),
    "ec_transfer_params": VllmExtra(Unsupported("disaggregated serving is not used", (None, {}))),
    "vllm_xargs": VllmExtra(Unsupported("no vLLM extension is installed to read them", (None, {}))),
}


def unsupported(endpoint: Endpoint) -> dict[str, Unsupported]:
    """The refused-unless-neutral rows of :data:`VLLM_EXTRAS` that apply to ``endpoint``."""
    return {name: e.rule for name, e in VLLM_EXTRAS.items()
            if endpoint in e.endpoints and isinstance(e.rule, Unsupported)}


def implemented(endpoint: Endpoint) -> dict[str, Implemented]:
    """The implemented rows of :data:`VLLM_EXTRAS` that apply to ``endpoint``."""
    return {name: e.rule for name, e in VLLM_EXTRAS.items()
            if endpoint in e.endpoints and isinstance(e.rule, Implemented)}
