"""Entrypoint of the reward stage: ``flywheel reward`` (or ``python -m reward.main``), and
``flywheel reward report``.

Consumes ``<prefix>episodes`` in the consumer group ``reward.group_id``, labels each episode with
the configured labelers (reward/labelers.py) behind the guards (reward/guards.py), emits one
reward per episode with a user signal to ``<prefix>rewards`` and archives it to Parquet under
``<data_dir>/archive/rewards``. State and offsets live in ``<data_dir>/reward/state.sqlite3``
with the same exactly-once protocol as ingest (ingest/exactly_once.py, docs/exactly-once.md).
With ``reward.shards`` set it owns those input partitions outright instead of joining the
group: one of several processes of the stage, each with a data_dir of its own
(docs/exactly-once.md, Scaling out). ``/metrics`` and ``/health`` on ``reward.host:reward.port``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flywheel.contracts import Topics
from flywheel.settings import Settings
from ingest.archive import ParquetArchive
from ingest.main import stop_on_signals
from ingest.runner import serve_stage
from reward.report import REWARD_SCHEMA, report, reward_row, reward_table
from reward.stage import REWARDS_ARCHIVE, SCHEMA, RewardStage


def run(settings: Settings, args: argparse.Namespace | None = None, stop: Any = None) -> int:
    """Run until SIGTERM/SIGINT, or until ``stop.is_set()`` when a stop flag is given."""
    archive_root = settings.data_dir / "archive" / "rewards"
    if args is not None and getattr(args, "action", "run") == "report":
        print(report(args.archive or archive_root, top=args.top))
        return 0
    cfg, topics = settings.reward, Topics(settings.topic_prefix)
    serve_stage(
        settings=settings,
        name="reward",
        group_id=cfg.group_id,
        inputs=[topics.episodes],
        schema=SCHEMA,
        make_stage=lambda store, registry: RewardStage(cfg, topics, store, registry),
        archives=lambda: {REWARDS_ARCHIVE: ParquetArchive(archive_root, REWARD_SCHEMA, reward_row, reward_table)},
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

    return cli_main(["reward", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
