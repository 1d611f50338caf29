"""Entrypoint of the ingest stage: ``flywheel ingest`` (or ``python -m ingest.main``).

Consumes ``<prefix>generations`` and ``<prefix>feedback`` in the consumer group
``ingest.group_id``, joins them by generation_id within ``ingest.window_s`` (ingest/join.py),
emits one episode per generation to ``<prefix>episodes``, archives episodes to Parquet under
``<data_dir>/archive/episodes`` and dead-letters every unusable record to ``<prefix>deadletter``.
State and offsets live in ``<data_dir>/ingest/state.sqlite3``; the exactly-once protocol is in
ingest/exactly_once.py and docs/exactly-once.md. With ``ingest.shards`` set it owns those input
partitions outright instead of joining the group: one of several processes of the stage, each
with a data_dir of its own (docs/exactly-once.md, Scaling out). ``/metrics`` and ``/health`` on
``ingest.host:ingest.port``. SIGTERM or Ctrl-C stops it cleanly; ``kill -9`` is safe too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from flywheel.contracts import Topics
from flywheel.settings import Settings
from ingest.archive import EPISODE_SCHEMA, ParquetArchive, episode_row, episode_table
from ingest.runner import serve_stage
from ingest.stage import EPISODES_ARCHIVE, SCHEMA, IngestStage


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def run(settings: Settings, args: argparse.Namespace | None = None, stop: Any = None) -> int:
    """Run until SIGTERM/SIGINT, or until ``stop.is_set()`` when a stop flag is given."""
    cfg, topics = settings.ingest, Topics(settings.topic_prefix)
    archive_root = settings.data_dir / "archive" / "episodes"
    serve_stage(
        settings=settings,
        name="ingest",
        group_id=cfg.group_id,
        inputs=[topics.generations, topics.feedback],
        schema=SCHEMA,
        make_stage=lambda store, registry: IngestStage(cfg, topics, store, registry),
        archives=lambda: {EPISODES_ARCHIVE: ParquetArchive(archive_root, EPISODE_SCHEMA, episode_row, episode_table)},
        host=cfg.host,
        port=cfg.port,
        max_batch=cfg.max_batch,
        poll_ms=cfg.poll_ms,
        stop=stop or stop_on_signals(),
        shards=cfg.shards,
    )
    return 0


def main(argv: list[str] | None = None) -> Any:
    from flywheel.cli import main as cli_main

    return cli_main(["ingest", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
