"""Entrypoint of the ingest stage: ``flywheel ingest`` (or ``python -m ingest.main``).

Consumes ``<prefix>generations`` and ``<prefix>feedback`` in the consumer group
``ingest.group_id``, joins them by generation_id within ``ingest.window_s`` (ingest/join.py),
emits one episode per generation to ``<prefix>episodes``, archives episodes to Parquet under
``<archive.root>/episodes`` (default ``<data_dir>/archive``) and dead-letters every unusable record to ``<prefix>deadletter``.
It runs on the stream runtime (flywheel/stream/, docs/exactly-once.md): state and offsets live
in ``<data_dir>/ingest/state.sqlite3``, or with ``stream.database_url`` in a database shared by
any number of replicas in the group (docs/shared-state.md). With ``ingest.shards`` set it owns those input
partitions outright instead of joining the group: one of several processes of the stage, each
with a data_dir of its own (docs/exactly-once.md, Scaling out). ``/metrics`` and ``/health`` on
``ingest.host:ingest.port``. SIGTERM or Ctrl-C stops it cleanly; ``kill -9`` is safe too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flywheel.contracts import Topics
from flywheel.settings import Settings
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.serve import StageSpec, serve_stage
from flywheel.telemetry import Tracing
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from ingest.stage import EPISODES_ARCHIVE, SCHEMA, IngestStage


def spec(settings: Settings, tracing: Tracing | None = None) -> StageSpec:
    """The ingest stage as the stream runtime runs it (``tracing``: its spans, flywheel/telemetry.py)."""
    cfg, topics = settings.ingest, Topics(settings.topic_prefix)
    archive_root = settings.archive_root / "episodes"
    return StageSpec(
        name="ingest",
        group_id=cfg.group_id,
        inputs=[topics.generations, topics.feedback],
        outputs=[topics.episodes, topics.deadletter],
        tables=SCHEMA,
        rules=lambda store, registry: IngestStage(cfg, topics, store, registry, tracing),
        archives=lambda: {EPISODES_ARCHIVE: ParquetArchive(archive_root, EPISODE_SCHEMA, episode_row, episode_table,
                                                         shared=bool(settings.stream.database_url))},
        host=cfg.host,
        port=cfg.port,
        max_batch=cfg.max_batch,
        poll_ms=cfg.poll_ms,
        shards=cfg.shards,
    )


def run(settings: Settings, args: argparse.Namespace | None = None, stop: Any = None) -> int:
    """Run until SIGTERM/SIGINT, or until ``stop.is_set()`` when a stop flag is given."""
    tracing = Tracing(settings.telemetry, "ingest")
    try:
        serve_stage(settings, spec(settings, tracing), stop)
    finally:
        tracing.shutdown()
    return 0


def main(argv: list[str] | None = None) -> Any:
    from cli.main import main as cli_main

    return cli_main(["ingest", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
