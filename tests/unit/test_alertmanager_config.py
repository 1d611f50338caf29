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


def test_two_deployments_alerts_are_not_grouped_together(tmp_path):
    """Two namespaces in one Alertmanager (the prometheus-operator's usual shape): the alerts carry
    `namespace`, and no job once aggregated per deployment. Grouped by job alone, team-b's page
    joined team-a's group and waited for its next interval (5 m), under team-a's notification. Run
    on Debian's alertmanager, on loopback, with this file's routing."""
    import socket
    import time

    import httpx

    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        pytest.skip("alertmanager is not installed (apt-get install prometheus-alertmanager; .ci/run does)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, f"--config.file={ROUTING}", f"--storage.path={tmp_path}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v2"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{api}/status", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        alerts = [{"alertname": "FlywheelReleaseNoController", "severity": "page", "namespace": ns}
                  for ns in ("team-a", "team-b")]
        httpx.post(f"{api}/alerts", json=[{"labels": a} for a in alerts], timeout=5).raise_for_status()
        for _ in range(50):
            groups = httpx.get(f"{api}/alerts/groups", timeout=5).json()
            if sum(len(g["alerts"]) for g in groups) == len(alerts):
                break
            time.sleep(0.1)
        assert sorted(g["labels"].get("namespace", "") for g in groups) == ["team-a", "team-b"], groups
    finally:
        proc.terminate()
        proc.wait(timeout=10)
