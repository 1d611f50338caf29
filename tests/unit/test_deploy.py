"""The production-shaped compose file gives every Flywheel process the time its stop takes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from flywheel.stream.runner import STOP_CLOSE_MS, STOP_FLUSH_S

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"


def _seconds(duration: str) -> float:
    """A compose duration such as ``30s``, ``1m30s`` or ``1500ms``, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_every_flywheel_service_outlasts_a_stop_during_a_broker_stall():
    # A stop waits up to STOP_FLUSH_S for acks and up to STOP_CLOSE_MS for each of the stage's
    # consumers and its claims poller (flywheel/stream/runner.py, flywheel/stream/claims.py): about 15 s measured.
    # Docker's default grace (10 s) ends it with SIGKILL part way; twice the bound leaves room.
    needed = 2 * (STOP_FLUSH_S + 3 * STOP_CLOSE_MS / 1000)
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ours = {name: svc for name, svc in services.items() if "build" in svc}
    assert {"ingest-a", "ingest-b", "reward", "serve", "train"} <= ours.keys()
    for name, svc in ours.items():
        assert "stop_grace_period" in svc, f"{name} has Docker's default grace period of 10 s"
        assert _seconds(svc["stop_grace_period"]) >= needed, f"{name}: {svc['stop_grace_period']} < {needed} s"


def test_durations_parse_as_compose_writes_them():
    assert _seconds("30s") == 30 and _seconds("1m30s") == 90 and _seconds("1500ms") == 1.5
