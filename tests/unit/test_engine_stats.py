"""serving/engine_stats.py without an engine: vLLM's per-step statistics become series labelled
by engine (slot) and version, and a reload moves the gauges to the new version."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from serving.engine_stats import EngineStats, FleetStatsCollector


def _scheduler(waiting: int, running: int, kv: float) -> SimpleNamespace:
    return SimpleNamespace(num_waiting_reqs=waiting, num_running_reqs=running, kv_cache_usage=kv)


def _iteration(ttft: list[float], itl: list[float]) -> SimpleNamespace:
    return SimpleNamespace(time_to_first_tokens_iter=ttft, inter_token_latencies_iter=itl)


def test_steps_become_series_per_engine_and_version_and_a_reload_moves_the_gauges():
    versions = {"stable": 3, "canary": 4}
    stable, canary = EngineStats(lambda: versions["stable"]), EngineStats(lambda: versions["canary"])
    registry = CollectorRegistry()
    registry.register(FleetStatsCollector([SimpleNamespace(stats=stable), SimpleNamespace(stats=canary),
                                           SimpleNamespace(stats=None)]))
    stable.record(_scheduler(2, 5, 0.25), _iteration([0.05, 0.2], [0.01, 0.02, 0.03]))
    canary.record(_scheduler(0, 1, 0.125), None)

    def value(name: str, engine: str, version: int) -> float | None:
        return registry.get_sample_value(name, {"engine": engine, "version": str(version)})

    assert value("serving_engine_time_to_first_token_seconds_count", "0", 3) == 2
    assert value("serving_engine_time_to_first_token_seconds_sum", "0", 3) == 0.25
    assert value("serving_engine_inter_token_latency_seconds_count", "0", 3) == 3
    assert (value("serving_engine_requests_waiting", "0", 3), value("serving_engine_requests_running", "0", 3),
            value("serving_engine_kv_cache_usage_ratio", "0", 3)) == (2, 5, 0.25)
    assert value("serving_engine_kv_cache_usage_ratio", "1", 4) == 0.125
    assert value("serving_engine_time_to_first_token_seconds_count", "1", 4) == 0  # no first token yet

    versions["stable"] = 5  # the slot reloaded
    stable.record(_scheduler(0, 1, 0.5), _iteration([0.1], []))
    assert value("serving_engine_kv_cache_usage_ratio", "0", 5) == 0.5
    assert value("serving_engine_kv_cache_usage_ratio", "0", 3) is None  # gauges describe the engine now
    assert value("serving_engine_time_to_first_token_seconds_count", "0", 3) == 2  # counts stay
    assert value("serving_engine_time_to_first_token_seconds_count", "0", 5) == 1
