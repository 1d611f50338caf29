"""Tokens served, counted for billing and capacity: by the version that answered and, where
``serve.metrics_key_ids`` asks, by API key (its id, never the key), as Prometheus counters.

``/metrics`` answers anyone who reaches the port, and an id is a keyed hash of the key: whoever
holds the salt (the published default, or a leaked one) checks guesses of a key against its id
offline. So by default the ``api_key`` label is the constant :data:`ALL_KEYS` (the series keep
their shape, and dashboards sum over the label either way); usage per key is ``flywheel usage``'s,
read from the episode archive, which records the id.

``serving_prompt_tokens_total`` and ``serving_completion_tokens_total`` count what each recorded
generation holds, under the same rules ``flywheel usage`` (cli/usage.py) sums the episode archive
by, so the two agree: a request's prompt once (with its first choice: the ``n`` choices of one
request share it, as OpenAI's ``usage`` counts it), every choice's completion tokens, all under
``model_version``, the version the request was routed to and the response names (tokens a weight
swap let another version sample stay with it: the archive keeps no spans).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from flywheel.contracts import GenerationEvent

#: The ``api_key`` label of a request made without a key (a deployment with none).
NO_KEY = "none"
#: The ``api_key`` label of every series while ``serve.metrics_key_ids`` is off.
ALL_KEYS = "all"


@dataclass(frozen=True)
class TokenCounters:
    generated: Counter   # serving_generated_tokens_total{model_version}
    prompt: Counter      # serving_prompt_tokens_total{api_key, model_version}
    completion: Counter  # serving_completion_tokens_total{api_key, model_version}
    by_key: bool = False  # serve.metrics_key_ids: the key id as the label, else ALL_KEYS

    @classmethod
    def register(cls, registry: CollectorRegistry, by_key: bool = False) -> TokenCounters:
        labels = ["api_key", "model_version"]
        return cls(
            Counter("serving_generated_tokens_total", "Completion tokens sampled", ["model_version"], registry=registry),
            Counter("serving_prompt_tokens_total", "Prompt tokens of recorded requests (once per request), "
                    "by version (and API key id with serve.metrics_key_ids)", labels, registry=registry),
            Counter("serving_completion_tokens_total", "Completion tokens of recorded generations, by version "
                    "(and API key id with serve.metrics_key_ids)", labels, registry=registry),
            by_key)

    def count(self, event: GenerationEvent) -> None:
        version = str(event.model_version)
        key = (event.api_key_id or NO_KEY) if self.by_key else ALL_KEYS
        self.generated.labels(version).inc(len(event.completion_token_ids))
        self.completion.labels(key, version).inc(len(event.completion_token_ids))
        if event.choice_index == 0:
            self.prompt.labels(key, version).inc(len(event.prompt_token_ids))
