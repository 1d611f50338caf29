"""Alert rules judged by Prometheus itself: ``promtool test rules`` on series made up here.

An idle, healthy loop pages nobody; a real collapse does. Needs ``promtool`` (Debian's
``prometheus`` package, which .ci/run installs).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "dashboards" / "prometheus" / "alerts.yml"
TRAINER = 'job="flywheel-trainer", instance="trainer:8300"'


def _alert(name: str) -> dict:
    return next(r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if r.get("alert") == name)


def _promtool(tmp_path: Path, series: dict[str, str], at: str, expected: list[dict],
              alertname: str = "FlywheelPolicyCollapse") -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    spec = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": at, "alertname": alertname, "exp_alerts": expected}],
    }]}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False)


def _firing() -> list[dict]:
    rule = _alert("FlywheelPolicyCollapse")
    return [{"exp_labels": {"severity": "page", "job": "flywheel-trainer", "instance": "trainer:8300"},
             "exp_annotations": rule["annotations"]}]


@pytest.mark.parametrize("name, entropy, distinct, steps, pages", [
    ("a trainer that has not trained yet exports zeros", "0x40", "0x40", "0x40", False),
    ("a trained, healthy policy", "2.1x40", "0.9x40", "0+1x40", False),
    ("a collapsed entropy after training", "0.2x40", "0.9x40", "0+1x40", True),
    ("collapsed diversity after training", "2.1x40", "0.1x40", "0+1x40", True),
])
def test_policy_collapse_pages_only_a_trainer_that_has_trained(tmp_path, name, entropy, distinct, steps, pages):
    series = {f"trainer_entropy_nats{{{TRAINER}}}": entropy,
              f"trainer_distinct_completions_ratio{{{TRAINER}}}": distinct,
              f"trainer_steps_total{{{TRAINER}}}": steps}
    done = _promtool(tmp_path, series, "30m", _firing() if pages else [])
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


def test_the_rule_test_itself_can_fail(tmp_path):
    """Expecting a page from the idle trainer must fail: the harness really judges the rule."""
    series = {f"trainer_entropy_nats{{{TRAINER}}}": "0x40", f"trainer_distinct_completions_ratio{{{TRAINER}}}": "0x40",
              f"trainer_steps_total{{{TRAINER}}}": "0x40"}
    done = _promtool(tmp_path, series, "30m", _firing())
    assert done.returncode != 0 and "FlywheelPolicyCollapse" in done.stdout + done.stderr


SERVING = 'job="flywheel-serve", instance="serve:8000"'


@pytest.mark.parametrize("reason, pages", [
    ("bad_signature", True),  # a forgery
    ("unknown_key", True),  # a key serving does not trust: a forgery, or a rotation out of order
    ("unsigned", True),
    ("invalid", False),  # malformed, not a question of who wrote it (FlywheelDeadLettersSpike's)
    ("version_refused", False),  # FlywheelVersionRefused's
])
def test_a_release_no_trusted_key_signed_pages(tmp_path, reason, pages):
    series = {f'serving_deadletters_total{{{SERVING}, reason="{reason}"}}': "0x5 1x20"}
    summary = f"Serving refused a release record no trusted key signed ({reason})"
    expected = [{"exp_labels": {"severity": "page", "reason": reason},
                 "exp_annotations": {"summary": summary, "runbook": "dashboards/runbooks/unverified-records.md"}}]
    done = _promtool(tmp_path, series, "10m", expected if pages else [], alertname="FlywheelUnverifiedRelease")
    assert done.returncode == 0, f"{reason}: {done.stdout}{done.stderr}"


RELEASE = 'job="flywheel-release", instance="release:8080"'


@pytest.mark.parametrize("reason, pages", [("bad_signature", True), ("unknown_key", True), ("unsigned", True),
                                           ("invalid", False)])
def test_a_checkpoint_no_trusted_key_signed_pages(tmp_path, reason, pages):
    # the controller's refusals: before, only serving's were watched, and a trainer whose key the
    # controller did not trust published versions that silently never became candidates
    series = {f'release_deadletters_total{{{RELEASE}, reason="{reason}"}}': "0x5 1x20"}
    summary = f"The release controller refused a checkpoint record no trusted key signed ({reason})"
    expected = [{"exp_labels": {"severity": "page", "reason": reason},
                 "exp_annotations": {"summary": summary, "runbook": "dashboards/runbooks/unverified-records.md"}}]
    done = _promtool(tmp_path, series, "10m", expected if pages else [], alertname="FlywheelUnverifiedCheckpoint")
    assert done.returncode == 0, f"{reason}: {done.stdout}{done.stderr}"
