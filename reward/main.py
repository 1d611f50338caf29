"""Entrypoint of the reward stage: ``flywheel reward`` (or ``python -m reward.main``), and
``flywheel reward report``.

Consumes ``<prefix>episodes`` in the consumer group ``reward.group_id``, labels each episode with
the configured labelers (reward/labelers.py) behind the guards (reward/guards.py), emits one
reward per episode with a user signal to ``<prefix>rewards`` and archives it to Parquet under
``<archive.root>/rewards`` (default ``<data_dir>/archive``). It runs on the stream runtime (flywheel/stream/,
docs/exactly-once.md): state and offsets live in ``<data_dir>/reward/state.sqlite3``, or with
``stream.database_url`` in a database shared by any number of replicas in the group
(docs/shared-state.md).
With ``reward.shards`` set it owns those input partitions outright instead of joining the
group: one of several processes of the stage, each with a data_dir of its own
(docs/exactly-once.md, Scaling out). ``/metrics`` and ``/health`` on ``reward.host:reward.port``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flywheel.contracts import Topics
from flywheel.output import as_json
from flywheel.settings import Settings
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.serve import StageSpec, serve_stage
from flywheel.telemetry import Tracing
from reward.report import REWARD_SCHEMA, report, report_json, reward_row, reward_table
from reward.stage import REWARDS_ARCHIVE, SCHEMA, RewardStage


def spec(settings: Settings, tracing: Tracing | None = None) -> StageSpec:
    """The reward stage as the stream runtime runs it (``tracing``: its spans, flywheel/telemetry.py)."""
    cfg, topics = settings.reward, Topics(settings.topic_prefix)
    archive_root = settings.archive_root / "rewards"
    return StageSpec(
        name="reward",
        group_id=cfg.group_id,
        inputs=[topics.episodes],
        outputs=[topics.rewards, topics.deadletter],
        tables=SCHEMA,
        rules=lambda store, registry: RewardStage(cfg, topics, store, registry, tracing),
        archives=lambda: {REWARDS_ARCHIVE: ParquetArchive(archive_root, REWARD_SCHEMA, reward_row, reward_table,
                                                         shared=bool(settings.stream.database_url))},
        host=cfg.host,
        port=cfg.port,
        max_batch=cfg.max_batch,
        poll_ms=cfg.poll_ms,
        shards=cfg.shards,
    )


def run(settings: Settings, args: argparse.Namespace | None = None, stop: Any = None) -> int:
    """Run until SIGTERM/SIGINT, or until ``stop.is_set()`` when a stop flag is given."""
    if args is not None and getattr(args, "action", "run") == "report":
        archive = args.archive or settings.archive_root / "rewards"
        if getattr(args, "output", "table") == "json":
            print(as_json(report_json(archive, top=args.top)))
        else:
            print(report(archive, top=args.top))
        return 0
    tracing = Tracing(settings.telemetry, "reward")
    try:
        serve_stage(settings, spec(settings, tracing), stop)
    finally:
        tracing.shutdown()
    return 0


def main(argv: list[str] | None = None) -> Any:
    from cli.main import main as cli_main

    return cli_main(["reward", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
