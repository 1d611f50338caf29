"""The stream runtime every consuming stage runs on (ingest, reward).

A stage is its rules plus a :class:`~flywheel.stream.serve.StageSpec`: its inputs, outputs,
tables and archives. The runtime does the rest, the same way for every stage:

- ``runner``: the loop: poll, decode at the edge (:func:`~flywheel.stream.runner.decode_keyed`),
  process a batch, one transaction for state + input offsets + outbox + archive queue, deliver,
  commit positions for lag tools;
- ``store``: the state store that transaction lives in: SQLite per process, or a database the
  stage's replicas share (``sql``: one SQL text on SQLite and PostgreSQL; docs/shared-state.md);
- ``outbox``: at-least-once delivery of what the stage owes to Kafka, and the archive writes;
- ``deadletters``: routing of unusable records to the dead-letter topic, with a reason;
- ``claims``: two processes never run the same shards from different stores (a shared store's
  leases do that instead);
- ``archive``: hourly Parquet files, written atomically;
- ``serve``: a stage as a process: topics, data_dir lock, claims, ops server, signals.

The delivery protocol, its guarantee and the readers' part in it: docs/exactly-once.md.
"""
