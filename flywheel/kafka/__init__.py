"""Kafka plumbing every stage shares, behind a small interface.

- ``clients``: producers, consumers, topic creation and one-off reads, configured from settings;
- ``producers``: the acked producers the stream runtime's outbox and the trainer send through;
- ``lag``: the consumer-lag gauge per topic and partition;
- ``patches``: fixes for kafka-python defects that would stop a reader, installed explicitly;
- ``batches``, ``headers``, ``ends``: what those patches do, one defect per module.
"""
