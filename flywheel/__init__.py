"""Flywheel's small shared package: wire contracts, settings, Kafka plumbing, metrics helpers.

Stages (``serving``, ``ingest``, ``reward``, ``trainer``, ``release``) share only what is here and
the topics between them; none imports another stage's code. Keep this package free of torch and
of stage logic: if something here grows judgement, it belongs to a stage.
"""

__version__ = "0.1.0"
