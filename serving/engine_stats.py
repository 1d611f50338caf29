"""vLLM's own engine statistics, per engine and version, on serving's ``/metrics``.

vLLM measures what an on-call engineer asks of an engine in its output handler and scheduler:
time to first token, inter-token latency (time per output token), requests waiting and running,
and the share of the KV cache in use. It hands them to stat loggers each engine step
(``vllm.v1.metrics.loggers``); :func:`stat_logger` builds the one each :class:`VllmEngine` passes
to ``AsyncLLM``, which writes them into :class:`EngineStats`, nothing recomputed here. The
histogram buckets are vLLM's own (``vllm.v1.metrics.buckets``).

Two engines live in one serving process (stable and canary), each with a version that changes on
a reload, and the registry belongs to the app, not to the engine (the tests' shared engine serves
one app after another). So an engine keeps its statistics in unregistered metrics labelled by
``version``, and :class:`FleetStatsCollector`, registered by the fleet, adds the ``engine`` label
(the slot) at scrape time:

    serving_engine_time_to_first_token_seconds{engine, version}   histogram
    serving_engine_inter_token_latency_seconds{engine, version}   histogram
    serving_engine_requests_waiting{engine, version}              gauge
    serving_engine_requests_running{engine, version}              gauge
    serving_engine_kv_cache_usage_ratio{engine, version}          gauge, 0..1

A gauge describes the engine now, so a reload drops the old version's gauges; the histograms keep
every version's counts (a counter that vanished would read as a reset).

Off with ``serve.engine_stats=false``; ``bench/engine_stats.py`` measures the cost of keeping them on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import Gauge, Histogram
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

#: vLLM's histogram families by our metric name (``vllm.v1.metrics.buckets``).
HISTOGRAMS = {
    "serving_engine_time_to_first_token_seconds": ("time_to_first_token",
                                                   "Seconds from a request's arrival to its first token (vLLM)"),
    "serving_engine_inter_token_latency_seconds": ("inter_token_latency",
                                                   "Seconds between a request's consecutive output tokens (vLLM)"),
}


class EngineStats:
    """One engine's statistics, labelled by the version it serves when vLLM reported them."""

    def __init__(self, version: Callable[[], int]) -> None:
        from vllm.v1.metrics.buckets import histogram_buckets

        self._version = version
        self._last: str | None = None
        (ttft, ttft_doc), (itl, itl_doc) = HISTOGRAMS.values()
        names = list(HISTOGRAMS)
        self.ttft = Histogram(names[0], ttft_doc, ["version"], registry=None, buckets=histogram_buckets(ttft))
        self.itl = Histogram(names[1], itl_doc, ["version"], registry=None, buckets=histogram_buckets(itl))
        self.waiting = Gauge("serving_engine_requests_waiting", "Requests queued in the engine's scheduler (vLLM)",
                             ["version"], registry=None)
        self.running = Gauge("serving_engine_requests_running", "Requests in the engine's running batch (vLLM)",
                             ["version"], registry=None)
        self.kv_cache = Gauge("serving_engine_kv_cache_usage_ratio", "Share of the KV cache's blocks in use, 0..1 (vLLM)",
                              ["version"], registry=None)

    def record(self, scheduler: Any, iteration: Any) -> None:
        """One engine step's ``SchedulerStats`` and ``IterationStats`` (either may be None)."""
        version = str(self._version())
        if version != self._last:
            self._relabel(version)
        if scheduler is not None:
            self.waiting.labels(version).set(scheduler.num_waiting_reqs)
            self.running.labels(version).set(scheduler.num_running_reqs)
            self.kv_cache.labels(version).set(scheduler.kv_cache_usage)
        if iteration is not None:
            ttft, itl = self.ttft.labels(version), self.itl.labels(version)
            for s in iteration.time_to_first_tokens_iter:
                ttft.observe(s)
            for s in iteration.inter_token_latencies_iter:
                itl.observe(s)

    def _relabel(self, version: str) -> None:
        if self._last is not None:
            for gauge in (self.waiting, self.running, self.kv_cache):
                try:
                    gauge.remove(self._last)
                except KeyError:  # no step reported scheduler stats under that version
                    pass
        # the histograms exist at zero from the version's first step, so its first request's
        # observation is an increase a rate() sees, not the birth of a series
        self.ttft.labels(version), self.itl.labels(version)
        self._last = version

    def metrics(self) -> tuple[Histogram | Gauge, ...]:
        return self.ttft, self.itl, self.waiting, self.running, self.kv_cache


def stat_logger(stats: EngineStats) -> type:
    """The stat logger class ``AsyncLLM(stat_loggers=[...])`` takes, writing into ``stats``.

    vLLM's ``StatLoggerManager`` adds its own ``PrometheusStatLogger`` unless a custom logger is
    one. That logger registers some forty ``vllm:`` metrics on prometheus_client's global registry
    (which serving does not expose: each process has its own), records them all every step, and
    unregisters every ``vllm:`` collector when the next engine starts, so the canary's start would
    wipe stable's. Subclassing it without its ``__init__`` keeps it out: ours is the only logger.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class FlywheelStatLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            # deliberately not super().__init__: see stat_logger's docstring
            self.engine_indexes = engine_indexes or [0]

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

    return FlywheelStatLogger


class FleetStatsCollector(Collector):
    """Every engine's :class:`EngineStats` with an ``engine`` label (its slot), at scrape time."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self._engines = engines

    def collect(self) -> Iterable[Any]:
        merged: dict[str, Any] = {}
        for slot, engine in enumerate(self._engines):
            stats: EngineStats | None = getattr(engine, "stats", None)
            if stats is None:  # statistics off, or an engine that keeps none
                continue
            for metric in stats.metrics():
                for family in metric.collect():
                    out = merged.setdefault(family.name, _empty_like(family))
                    out.samples.extend(Sample(s.name, {**s.labels, "engine": str(slot)}, s.value, s.timestamp,
                                              s.exemplar) for s in family.samples)
        return merged.values()


def _empty_like(family: Any) -> Any:
    from prometheus_client.metrics_core import Metric

    return Metric(family.name, family.documentation, family.type, family.unit)
