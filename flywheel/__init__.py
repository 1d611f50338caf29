"""Flywheel's shared package: what every stage needs and no stage's rules.

- ``contracts``: every record on every topic; ``settings``: configuration, parsed once;
- ``kafka/``: Kafka plumbing; ``stream/``: the stream runtime ingest and reward run on;
- ``checkpoints/``: the checkpoint store's format, for its writer and its readers;
- ``scorers``: the registry of deployment-supplied verifiers and reward models;
- ``metrics``, ``durable``, ``modelinit``: metrics helpers, fsync helpers, a small model built
  from a config.

Stages (``serving``, ``ingest``, ``reward``, ``trainer``, ``release``) share only what is here and
the topics between them; none imports another stage's code (tests/unit/test_house.py). Keep this
package free of torch and of stage logic: if something here grows judgement, it belongs to a stage.
"""

__version__ = "0.1.0"
