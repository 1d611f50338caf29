"""``<stage>_consumer_lag_records{topic,partition}``: a lag gauge per topic and partition.

Lag is computed from the *fetch high watermark* (``consumer.highwater``), not from
``end_offsets``: the embedded broker reports a wrong end offset, and the fetch response's
watermark is what a real cluster reports too. For a read_committed consumer the end is the
fetch response's last stable offset where that is lower (flywheel/kafka/ends.py).
"""

from __future__ import annotations

import logging
import time

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from prometheus_client import CollectorRegistry, Gauge

from flywheel.kafka.ends import readable_end

log = logging.getLogger(__name__)


class LagGauge:
    """``<stage>_consumer_lag_records{topic,partition}`` from the fetch high watermark."""

    def __init__(self, stage: str, registry: CollectorRegistry) -> None:
        self.gauge = Gauge(
            f"{stage}_consumer_lag_records",
            "Records between the consumer's position and the partition's high watermark",
            ["topic", "partition"],
            registry=registry,
        )
        self._last = 0.0
        self._shown: set[TopicPartition] = set()

    def update(self, consumer: KafkaConsumer, every_s: float = 1.0) -> None:
        if time.monotonic() - self._last < every_s:
            return
        self._last = time.monotonic()
        assigned = set(consumer.assignment())
        # a partition that moved to another member is that member's to report: its last value
        # here would stay forever, and keep a lag alert firing for a partition long caught up
        for tp in self._shown - assigned:
            self.gauge.remove(tp.topic, str(tp.partition))
        self._shown &= assigned
        for tp in assigned:
            high = readable_end(consumer, tp)
            if high is None:
                continue
            try:
                pos = consumer.position(tp, timeout_ms=100)
            except KafkaError as exc:  # position unknown during a rebalance; try next time
                log.debug("lag for %s not updated: %s", tp, exc)
                continue
            if pos is not None:
                self.gauge.labels(tp.topic, str(tp.partition)).set(max(0, high - pos))
                self._shown.add(tp)

