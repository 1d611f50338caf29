"""vLLM's engine statistics on serving's /metrics: the session's shared engine answers real
requests over HTTP on loopback and the exported numbers move (serving/engine_stats.py)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_ttft_itl_running_and_kv_cache_are_exported_per_engine_and_version(serve, engine):
    s = serve()
    ids = {"engine": "0", "version": str(engine[1].model_version)}
    s.client.completions.create(model="flywheel", prompt="warm", max_tokens=2)  # the series exist from here
    before = scrape(s.url)
    ttft0 = sample(before, "serving_engine_time_to_first_token_seconds_count", **ids)
    itl0 = sample(before, "serving_engine_inter_token_latency_seconds_count", **ids)
    assert ttft0 is not None and itl0 is not None, "no engine statistics for engine 0 at its version"

    # mid-stream, the engine holds the request: it runs, and its KV blocks are in use
    stream = s.client.completions.create(model="flywheel", prompt="tell me a long story", max_tokens=48,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    during = scrape(s.url)
    rest = list(chunks)
    assert rest, "the stream ended before it was scraped"
    assert sample(during, "serving_engine_requests_running", **ids) >= 1
    assert 0 < sample(during, "serving_engine_kv_cache_usage_ratio", **ids) <= 1
    assert sample(during, "serving_engine_requests_waiting", **ids) >= 0

    for _ in range(3):
        s.client.completions.create(model="flywheel", prompt="count my tokens", max_tokens=6,
                                    extra_body={"ignore_eos": True})
    after = scrape(s.url)
    # one first token per request (the stream's and three more); 47 + 3 * 5 gaps between tokens
    assert sample(after, "serving_engine_time_to_first_token_seconds_count", **ids) >= ttft0 + 4
    assert sample(after, "serving_engine_inter_token_latency_seconds_count", **ids) >= itl0 + 47 + 15
    assert sample(after, "serving_engine_time_to_first_token_seconds_sum", **ids) > 0
    # once nothing runs, the gauges say so
    assert sample(after, "serving_engine_requests_running", **ids) == 0
    assert sample(after, "serving_engine_kv_cache_usage_ratio", **ids) < sample(
        during, "serving_engine_kv_cache_usage_ratio", **ids)
