"""Where a consumer can read a partition up to: the last stable offset, kept by kafka-python.

The stages read their inputs ``read_committed`` (flywheel/kafka/clients.py ``make_consumer``): a product's
producer may write the input topics in transactions, and the records of a transaction that is
still open may yet be aborted, so they are no input until it commits (on a real cluster, aborted
records are never handed out at all). Such a consumer reads a partition up to its *last stable
offset* (the first offset of the oldest open transaction), not up to its high watermark.

Fetch responses carry both, but kafka-python 3 keeps only the high watermark. Compared with it,
a partition holding an open transaction would never count as read to its end: ingest's shard
would never count as caught up (its join windows would not close) and the lag gauge would show
the open transaction's records as lag the stage could read. :func:`record_last_stable_offsets`
keeps the last stable offset beside the high watermark, and :func:`readable_end` gives the end a
consumer can read to.

The hook wraps a private method of kafka-python's fetcher: tests/integration/
test_upstream_transactions.py holds a transaction open on a real broker, so a kafka-python
release that moves the method fails that test rather than production.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import Fetcher


def record_last_stable_offsets() -> None:
    """Keep each fetch response's last stable offset on its partition's state (once per process)."""
    parse = Fetcher._parse_fetched_data
    if getattr(parse, "_flywheel_lso", False):
        return

    def parse_fetched_data(self: Fetcher, completed_fetch: Any) -> Any:
        data = completed_fetch.partition_data
        state = self._subscriptions.assignment.get(completed_fetch.topic_partition)
        stable = getattr(data, "last_stable_offset", None)
        if state is not None and data.error_code == 0 and stable is not None and stable >= 0:
            state.flywheel_last_stable = stable
        return parse(self, completed_fetch)

    parse_fetched_data._flywheel_lso = True  # type: ignore[attr-defined]
    Fetcher._parse_fetched_data = parse_fetched_data  # type: ignore[method-assign]


def readable_end(consumer: KafkaConsumer, tp: TopicPartition) -> int | None:
    """The offset ``consumer`` can read ``tp`` up to by its last fetch: the last stable offset
    for a ``read_committed`` consumer, else the high watermark; None before the first fetch."""
    high = consumer.highwater(tp)
    if high is None or consumer.config.get("isolation_level") != "read_committed":
        return high
    state = consumer._subscription.assignment.get(tp)
    stable = getattr(state, "flywheel_last_stable", None)
    return high if stable is None else min(stable, high)
