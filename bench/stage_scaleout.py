"""The ingest and reward stages run as 1..N shard processes, against one raw consumer.

Run: ``python bench/stage_scaleout.py [--pairs 40000] [--processes 1,2]``. One embedded broker;
per process count, fresh topics with that many partitions (at least 2) holding ``pairs``
generations and one feedback each. Then:

- raw: one consumer group member reading every input record and nothing else, in this process;
- ingest / reward: the stage as the deployed command (``python -m ingest.main``), as N processes
  with ``shards`` split between them and a data_dir each (docs/exactly-once.md, Scaling out).

A stage's rate is taken from its processes' ``/health`` (``records_in``, ``delivered``), polled
every 50 ms: the clock starts when the first records are in and stops when every output is
delivered, and only records after the first poll that saw any are counted, as in
bench/ingest_throughput.py. Process start-up (imports, joins) is therefore not counted. This
measures wall-clock throughput with every process sharing the machine's cores with the broker:
compare the rows of one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the feed and raw consumer of ingest_throughput
from ingest_throughput import WINDOW_S, produce, raw_rate

from flywheel.contracts import Topics
from flywheel.kafka.topics import ensure_declared
from flywheel.settings import KafkaSettings
from local.broker import EmbeddedBroker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
            return json.load(resp)
    except OSError:
        return None


def stage_rate(stage: str, env: dict[str, str], procs: int, partitions: int, inputs: int,
               outputs: int, work: Path) -> float:
    """Input records/s of ``stage`` as ``procs`` shard processes, from their /health counters."""
    split = [[p for p in range(partitions) if p % procs == k] for k in range(procs)]
    ports = [free_port() for _ in split]
    children = [subprocess.Popen(
        [sys.executable, "-m", f"{stage}.main"],
        env={**env, "FLYWHEEL_DATA_DIR": str(work / f"{stage}-{k}"),
             f"FLYWHEEL_{stage.upper()}_SHARDS": ",".join(map(str, shards)),
             f"FLYWHEEL_{stage.upper()}_PORT": str(port)},
    ) for k, (shards, port) in enumerate(zip(split, ports))]
    try:
        start, first = None, 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            states = [health(port) for port in ports]
            if all(states):
                now = time.perf_counter()
                seen = sum(s["records_in"] for s in states)
                if start is None and seen:
                    start, first = now, seen
                if sum(s["delivered"] for s in states) >= outputs:
                    if now == start:  # all of it happened before the first sample: no interval
                        raise SystemExit(f"{stage} processed all {inputs} records between two "
                                         "samples of /health: run with more --pairs")
                    return (inputs - first) / (now - start)
            if any(c.poll() is not None for c in children):
                raise RuntimeError(f"a {stage} process exited early")
            time.sleep(0.05)
        raise RuntimeError(f"{stage} did not deliver {outputs} records in time")
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)


def run(bootstrap: str, procs: int, pairs: int, work: Path) -> list[tuple[str, float]]:
    partitions = max(2, procs)
    cfg = KafkaSettings(bootstrap=bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500,
                        partitions=partitions)
    topics = Topics(f"s{uuid.uuid4().hex[:6]}.")
    ensure_declared(cfg, topics)
    produce(cfg, topics, pairs)
    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": bootstrap, "FLYWHEEL_KAFKA_PARTITIONS": str(partitions),
           "FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS": "2000", "FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
           "FLYWHEEL_TOPIC_PREFIX": topics.prefix, "FLYWHEEL_INGEST_WINDOW_S": str(WINDOW_S),
           "FLYWHEEL_INGEST_GRACE_S": "0", "FLYWHEEL_LOG_LEVEL": "WARNING",
           # groups of this block only (see the group quirk in local/broker.py)
           "FLYWHEEL_INGEST_GROUP_ID": f"{topics.prefix}ingest", "FLYWHEEL_REWARD_GROUP_ID": f"{topics.prefix}reward"}
    work = work / f"p{procs}"
    raw_in = raw_rate(cfg, [topics.generations, topics.feedback], 2 * pairs)[0]
    ingest = stage_rate("ingest", env, procs, partitions, 2 * pairs, pairs, work)
    raw_ep = raw_rate(cfg, [topics.episodes], pairs)[0]
    reward = stage_rate("reward", env, procs, partitions, pairs, pairs, work)
    return [("raw consume (generations+feedback)", raw_in), (f"ingest, {procs} process(es)", ingest),
            ("raw consume (episodes)", raw_ep), (f"reward, {procs} process(es)", reward)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=40_000)
    ap.add_argument("--processes", default="1,2", help="process counts to measure, comma-separated")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        blocks = [run(broker.bootstrap, int(p), args.pairs, Path(tmp)) for p in args.processes.split(",")]
    print(f"\n{args.pairs} generations + {args.pairs} feedback, embedded broker, {os.cpu_count()} cores\n")
    print(f"{'path':<40}{'records/s':>11}{'vs raw':>8}")
    for block in blocks:
        for i, (label, rate) in enumerate(block):
            base = block[0][1] if i < 2 else block[2][1]
            print(f"{label:<40}{rate:>11,.0f}{rate / base:>8.2f}")


if __name__ == "__main__":
    main()
