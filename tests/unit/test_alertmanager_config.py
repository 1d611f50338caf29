"""deploy/alertmanager.yml routes every alert the rules raise, and the compose file wires
Prometheus to it. The routing itself is run for real by tests/integration/test_alerts_fire.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROUTING = ROOT / "deploy" / "alertmanager.yml"


def _severities() -> set[str]:
    doc = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "alerts.yml").read_text())
    return {rule["labels"]["severity"] for group in doc["groups"] for rule in group["rules"] if "alert" in rule}


def test_each_severity_has_a_route_to_a_receiver_of_its_own():
    doc = yaml.safe_load(ROUTING.read_text())
    receivers = {r["name"] for r in doc["receivers"]}
    routed = {}
    for route in doc["route"]["routes"]:
        (matcher,) = route["matchers"]
        name, value = matcher.split("=")
        assert name == "severity"
        routed[value.strip('"')] = route["receiver"]
    assert _severities() == {"page", "ticket"}
    assert routed == {"page": "page", "ticket": "ticket"} and receivers == {"page", "ticket"}


def test_alertmanager_accepts_the_file():
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (apt-get install prometheus-alertmanager; .ci/run does)")
    done = subprocess.run([amtool, "check-config", str(ROUTING)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_runs_alertmanager_and_prometheus_sends_to_it():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    am = compose["services"]["alertmanager"]
    assert "./alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in am["volumes"]
    port = am["ports"][0].split(":")[-1]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for am_cfg in prom["alerting"]["alertmanagers"] for sc in am_cfg["static_configs"] for t in sc["targets"]]
    assert targets == [f"alertmanager:{port}"]
