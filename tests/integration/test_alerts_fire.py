"""Alerts that fire for real: Debian's Prometheus and Alertmanager against a running ``flywheel up``.

Prometheus loads the project's alert and recording rules (dashboards/prometheus/), with only the
``for:`` durations shortened, and scrapes every stage ``flywheel up`` started at the ports its
status.json names. Two faults, each followed from Prometheus' HTTP API (``firing``) to a webhook
receiver on loopback that Alertmanager delivers to, routed as deploy/alertmanager.yml routes:

- the trainer stopped with SIGSTOP, so its ops port accepts connections and answers nothing (a
  hung process, which a restart-on-exit supervisor does not notice): FlywheelProcessDown, a page;
- a signed release naming a canary, which serving under ``flywheel up`` (one engine) refuses:
  FlywheelVersionRefused, a ticket.

Each delivered alert carries the runbook link built from the deployment's ``runbooks_url``
external label. Needs ``prometheus`` and ``prometheus-alertmanager`` (Debian
packages; .ci/run installs them). Slow: ``flywheel up`` starts a vLLM engine and the trainer.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from local.up import status_path

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus"
ROUTING = ROOT / "deploy" / "alertmanager.yml"
#: stage name in ``flywheel up`` -> the job name the rules and deploy/prometheus.yml use
JOBS = {"serve": "flywheel-serve", "ingest": "flywheel-ingest", "reward": "flywheel-reward",
        "train": "flywheel-trainer", "release": "flywheel-release"}
RUNBOOKS = "https://runbooks.test/flywheel"


def _binary(*names: str) -> str:
    for name in names:
        if path := shutil.which(name):
            return path
    pytest.skip(f"{names[0]} is not installed (apt-get install prometheus prometheus-alertmanager; .ci/run does)")


class Receiver:
    """Alertmanager's webhook receiver: every POSTed notification, decoded, on a queue."""

    def __init__(self) -> None:
        got: queue.Queue = queue.Queue()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                got.put(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.got = got
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, alertname: str, deadline: float, **labels: str) -> dict:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"Alertmanager delivered no firing {alertname} {labels}"
            try:
                note = self.got.get(timeout=left)
            except queue.Empty:
                continue
            for alert in note["alerts"]:
                got = alert["labels"]
                if (alert["status"] == "firing" and got.get("alertname") == alertname
                        and all(got.get(k) == v for k, v in labels.items())):
                    return {**alert, "receiver": note["receiver"]}


def _until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return got


def _short_rules(out: Path) -> list[Path]:
    """The project's rule files, each alert's ``for:`` cut to 2 s (nothing else changes)."""
    files = []
    for src in sorted(RULES.glob("*.yml")):
        doc = yaml.safe_load(src.read_text())
        for group in doc["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "2s"
        files.append(out / src.name)
        files[-1].write_text(yaml.safe_dump(doc))
    return files


def _alertmanager_config(out: Path, receiver_url: str) -> Path:
    """deploy/alertmanager.yml's routes, with its receivers pointed at the test's webhook and its
    waits cut to a second (the routing tree itself, which severity goes where, is the project's)."""
    doc = yaml.safe_load(ROUTING.read_text())
    for r in doc["receivers"]:
        for key in [k for k in r if k.endswith("_configs")]:
            del r[key]
        r["webhook_configs"] = [{"url": receiver_url, "send_resolved": False}]

    def fast(route: dict) -> None:
        route.update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for child in route.get("routes", []):
            fast(child)

    fast(doc["route"])
    path = out / "alertmanager.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _firing(prom: str, alertname: str, **labels: str) -> str | None:
    try:
        alerts = httpx.get(prom + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    except (httpx.HTTPError, ValueError):
        return None
    states = [a["state"] for a in alerts if a["labels"].get("alertname") == alertname
              and all(a["labels"].get(k) == v for k, v in labels.items())]
    return "firing" if "firing" in states else ("pending" if states else None)


def _up(prom: str, job: str) -> bool:
    try:
        result = httpx.get(prom + "/api/v1/query", params={"query": f'up{{job="{job}"}}'}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(r["value"][1] == "1" for r in result["data"]["result"])


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _announce_canary(bootstrap: str, keys: Path) -> None:
    """A canary release on flywheel up's releases topic, signed with the key up made for the
    release controller (a revision above any the controller has published)."""
    from kafka import KafkaProducer

    from flywheel.contracts import ReleaseEvent, Topics, VersionRef, encode
    from flywheel.settings import Settings
    from flywheel.signing import Signer

    settings = Settings()
    ev = ReleaseEvent(revision=1_000_000, deployment=settings.release.deployment, stable_version=0,
                      canary_version=7, canary_share=0.5, reason="alert test",
                      canary_ref=VersionRef(version=7, uri="file:///nowhere/7", manifest_sha256="0" * 64),
                      updated_at=time.time())
    value = encode(ev)
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        producer.send(Topics(settings.topic_prefix).releases, key=ev.deployment.encode(), value=value,
                      headers=Signer.load(keys / "release-local.key").headers(value)).get(timeout=30)
    finally:
        producer.close()


def test_a_hung_trainer_and_a_refused_release_alert_through_prometheus_and_alertmanager(tmp_path, tiny_model_dir):
    from local.broker import free_port

    prometheus = _binary("prometheus")
    alertmanager = _binary("prometheus-alertmanager", "alertmanager")
    receiver = Receiver()
    ports = {k: str(free_port()) for k in ("SERVE", "INGEST", "REWARD", "TRAINER", "RELEASE")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update({f"FLYWHEEL_{k}_PORT": v for k, v in ports.items()}, FLYWHEEL_DATA_DIR=str(tmp_path / "up"),
               FLYWHEEL_MODEL_DIR=str(tiny_model_dir), FLYWHEEL_SERVE_ENGINES="1", FLYWHEEL_API_KEYS="sk-alerts")
    procs: list[subprocess.Popen] = []
    stopped_pid = None
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=(logs / f"{name}.log").open("w"), stderr=subprocess.STDOUT, **kw)
        procs.append(p)
        return p

    try:
        start("up", [sys.executable, "-m", "cli", "up"], env=env)
        status = status_path(tmp_path / "up")
        stages = _until(lambda: status.exists() and json.loads(status.read_text())["stages"], 120, "status.json")

        am_port, prom_port = free_port(), free_port()
        am_config = _alertmanager_config(tmp_path, receiver.url)
        start("alertmanager", [alertmanager, f"--config.file={am_config}", f"--storage.path={tmp_path / 'am'}",
                               f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="])
        prom_config = {
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s",
                       "external_labels": {"runbooks_url": RUNBOOKS}},
            "rule_files": [str(p) for p in _short_rules(tmp_path)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": JOBS[s["name"]], "static_configs": [{"targets": [f"127.0.0.1:{s['port']}"]}]}
                               for s in stages],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom_config))
        prom = f"http://127.0.0.1:{prom_port}"
        start("prometheus", [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"])

        # the trainer is scraped, and nothing pages about it, before the fault
        _until(lambda: _up(prom, "flywheel-trainer"), 240, "Prometheus to scrape the trainer")
        assert _firing(prom, "FlywheelProcessDown", job="flywheel-trainer") is None

        trainer = next(s for s in json.loads(status.read_text())["stages"] if s["name"] == "train")
        os.kill(trainer["pid"], signal.SIGSTOP)
        stopped_pid = trainer["pid"]

        state = _until(lambda: _firing(prom, "FlywheelProcessDown", job="flywheel-trainer") == "firing", 120,
                       "FlywheelProcessDown to fire in Prometheus")
        assert state
        alert = receiver.wait_for("FlywheelProcessDown", time.monotonic() + 120, job="flywheel-trainer")
        assert alert["labels"]["severity"] == "page" and alert["receiver"] == "page"
        assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}/process-down.md"
        assert "flywheel-trainer" in alert["annotations"]["summary"]

        # a release serving cannot apply, signed as the controller signs: flywheel up serves with
        # one engine, so a canary is refused (no_canary_engine), and the ticket reaches its receiver
        serve = next(s for s in stages if s["name"] == "serve")
        _until(lambda: _ready(f"http://127.0.0.1:{serve['port']}/readyz"), 300, "serving to be ready")
        assert _firing(prom, "FlywheelVersionRefused", reason="no_canary_engine") is None
        _announce_canary(json.loads(status.read_text())["broker"]["bootstrap"], tmp_path / "up" / "keys")
        _until(lambda: _firing(prom, "FlywheelVersionRefused", reason="no_canary_engine") == "firing", 120,
               "FlywheelVersionRefused to fire in Prometheus")
        alert = receiver.wait_for("FlywheelVersionRefused", time.monotonic() + 120, reason="no_canary_engine")
        assert alert["labels"]["severity"] == "ticket" and alert["receiver"] == "ticket"
        assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}/version-refused.md"
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)  # so flywheel up can stop it
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                p.kill()
