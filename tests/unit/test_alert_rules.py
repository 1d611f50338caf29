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


def _link(runbook: str) -> str:
    """A rule's runbook_url as promtool renders it: Debian's promtool (2.42) takes no external
    labels in a rule test, so the deployment's ``runbooks_url`` renders empty."""
    return f"/{runbook}"


def _annotations(name: str) -> dict[str, str]:
    rule = _alert(name)
    return {**rule["annotations"], "runbook_url": _link(rule["annotations"]["runbook_url"].rsplit("/", 1)[1])}


def _firing() -> list[dict]:
    return [{"exp_labels": {"severity": "page", "job": "flywheel-trainer", "instance": "trainer:8300"},
             "exp_annotations": _annotations("FlywheelPolicyCollapse")}]


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
                 "exp_annotations": {"summary": summary, "runbook_url": _link("unverified-records.md")}}]
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
                 "exp_annotations": {"summary": summary, "runbook_url": _link("unverified-records.md")}}]
    done = _promtool(tmp_path, series, "10m", expected if pages else [], alertname="FlywheelUnverifiedCheckpoint")
    assert done.returncode == 0, f"{reason}: {done.stdout}{done.stderr}"


# -- the release controller's alerts -------------------------------------------------------------

REPLICAS = ('job="flywheel-release", instance="release-a:8100"', 'job="flywheel-release", instance="release-b:8100"')


@pytest.mark.parametrize("name, a, b, fires", [
    ("one replica holds the lease", "1x10", "0x10", False),
    ("the lease moves to the other replica", "1x3 0x7", "0x3 1x7", False),
    ("neither holds it", "1x2 0x8", "0x10", True),
])
def test_no_controller_holding_the_lease_pages(tmp_path, name, a, b, fires):
    series = {f"release_lease_held{{{REPLICAS[0]}}}": a, f"release_lease_held{{{REPLICAS[1]}}}": b,
              **{f"up{{{r}}}": "1x10" for r in REPLICAS}}
    expected = [{"exp_labels": {"severity": "page"}, "exp_annotations": _annotations("FlywheelReleaseNoController")}]
    done = _promtool(tmp_path, series, "9m", expected if fires else [], alertname="FlywheelReleaseNoController")
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


def test_no_controller_scraped_at_all_pages(tmp_path):
    series = {f"up{{{REPLICAS[0]}}}": "0x10"}  # the controller's own metrics are gone with it
    expected = [{"exp_labels": {"severity": "page"}, "exp_annotations": _annotations("FlywheelReleaseNoController")}]
    done = _promtool(tmp_path, series, "9m", expected, alertname="FlywheelReleaseNoController")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("alert, state, values, fires", [
    ("FlywheelReleaseApprovalWaiting", "awaiting_approval", "0+60x100", False),  # 100 min: under two hours
    ("FlywheelReleaseApprovalWaiting", "awaiting_approval", "0+60x150", True),
    ("FlywheelReleaseApprovalWaiting", "held", "0+60x150", False),  # another state's seconds
    ("FlywheelReleaseCanaryHeld", "held", "0x150", False),
    ("FlywheelReleaseCanaryHeld", "held", "0x140 0+60x10", True),
])
def test_release_state_tickets(tmp_path, alert, state, values, fires):
    # both replicas export the same seconds (read from one database): one ticket, not two
    series = {f'release_state_seconds{{{r}, state="{state}"}}': values for r in REPLICAS}
    expected = [{"exp_labels": {"severity": "ticket"}, "exp_annotations": _annotations(alert)}]
    done = _promtool(tmp_path, series, "150m", expected if fires else [], alertname=alert)
    assert done.returncode == 0, f"{alert} {state} {values}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("rollbacks, fires", [(5, False), (6, True)])
def test_rollbacks_over_five_a_day_ticket(tmp_path, rollbacks, fires):
    # a counter on the replica that acted; spread over the day (one every 3 hours)
    per_step = f"0+{rollbacks / 24 / 60 * 1.0:.6f}x1500"
    series = {f'release_decisions_total{{{REPLICAS[0]}, outcome="rolled_back", actor_kind="controller"}}': per_step,
              f'release_decisions_total{{{REPLICAS[0]}, outcome="promoted", actor_kind="policy"}}': "0+1x1500"}
    expected = [{"exp_labels": {"severity": "ticket"}, "exp_annotations": _annotations("FlywheelReleaseRollbacks")}]
    done = _promtool(tmp_path, series, "1440m", expected if fires else [], alertname="FlywheelReleaseRollbacks")
    assert done.returncode == 0, f"{rollbacks}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("outcome", ["failed", "dropped", "refused"])
@pytest.mark.parametrize("failed, fires", [("0x40", False), ("0x20 1x20", True)])
def test_webhook_given_up_tickets(tmp_path, failed, fires, outcome):
    """A body given up, dropped from a full queue or refused (an internal address) never reached
    the chat: each tickets; retries alone do not."""
    series = {f'release_webhook_deliveries_total{{{REPLICAS[0]}, outcome="{outcome}"}}': failed,
              f'release_webhook_deliveries_total{{{REPLICAS[0]}, outcome="retried"}}': "0+1x40"}
    expected = [{"exp_labels": {"severity": "ticket"}, "exp_annotations": _annotations("FlywheelReleaseWebhookFailing")}]
    done = _promtool(tmp_path, series, "30m", expected if fires else [], alertname="FlywheelReleaseWebhookFailing")
    assert done.returncode == 0, f"{failed}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("name, stalled, fires", [
    ("a healthy trainer", "0x15", False),
    # the fault run's unreadable store: 10-30 s, waited out (docs/trainer.md)
    ("a checkpoint store out of reach for 30 s", "0x3 30 0x11", False),
    ("a store (or Kafka) out of reach for minutes", "0x2 0+60x13", True),
])
def test_a_stalled_trainer_pages_only_past_minutes(tmp_path, name, stalled, fires):
    series = {f"trainer_stalled_seconds{{{TRAINER}}}": stalled}
    expected = [{"exp_labels": {"severity": "page"}, "exp_annotations": _annotations("FlywheelStageStalled")}]
    done = _promtool(tmp_path, series, "14m", expected if fires else [], alertname="FlywheelStageStalled")
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("stalled, fires", [("0x15", False), ("0x2 0+60x13", True)])
def test_a_release_controller_stalled_on_its_database_pages(tmp_path, stalled, fires):
    """A read-only or full release database: reads work (release_database_up stays 1), every
    turn's write fails, and only release_stalled_seconds says so."""
    series = {f"release_stalled_seconds{{{RELEASE}}}": stalled, f"release_database_up{{{RELEASE}}}": "1x15"}
    expected = [{"exp_labels": {"severity": "page"}, "exp_annotations": _annotations("FlywheelStageStalled")}]
    done = _promtool(tmp_path, series, "14m", expected if fires else [], alertname="FlywheelStageStalled")
    assert done.returncode == 0, f"{stalled}: {done.stdout}{done.stderr}"


SERVE_A, SERVE_B = 'job="flywheel-serving", instance="serving-a:8000"', 'job="flywheel-serving", instance="serving-b:8000"'


@pytest.mark.parametrize("unconfirmed, fires", [
    ("0x10", False),  # every pod runs a routing the controller announced
    ("0x2 1x8", True),  # a pod's wait for one ran out: it serves the model directory
    ("1x1 0x9", False),  # the controller's announcement arrived a minute later: cleared
])
def test_a_serving_pod_without_a_routing_pages(tmp_path, unconfirmed, fires):
    series = {f"serving_release_routing_unconfirmed{{{SERVE_A}}}": unconfirmed,
              f"serving_release_routing_unconfirmed{{{SERVE_B}}}": "0x10"}
    expected = [{"exp_labels": {"severity": "page", "job": "flywheel-serving", "instance": "serving-a:8000"},
                 "exp_annotations": {**_annotations("FlywheelServingWithoutRouting"),
                                     "summary": "A serving pod (serving-a:8000) serves the model directory with no "
                                                "routing from the release controller"}}]
    done = _promtool(tmp_path, series, "9m", expected if fires else [], alertname="FlywheelServingWithoutRouting")
    assert done.returncode == 0, f"{unconfirmed}: {done.stdout}{done.stderr}"
CONTROLLER = 'job="flywheel-release", instance="release:8100"'


# (what, serving replicas' verified, controller's verified, serving's API keys) -> the records alerted
@pytest.mark.parametrize("name, serving, controller, keys, fires", [
    ("everything verified, with keys", ("1x30", "1x30"), "1x30", "2x30", []),
    ("nothing verified, but an anonymous deployment", ("0x30", "0x30"), "0x30", "0x30", []),
    ("one serving replica unverified", ("1x30", "0x30"), "1x30", "2x30", ["release"]),
    ("the controller unverified", ("1x30", "1x30"), "0x30", "2x30", ["checkpoint"]),
    ("both unverified", ("0x30", "0x30"), "0x30", "1x30", ["release", "checkpoint"]),
    ("unverified for a moment (a rollout)", ("1x30", "0x5 1x25"), "1x30", "2x30", []),
    ("a serving that follows no releases exports nothing", (None, None), "1x30", "2x30", []),
])
def test_reading_records_unverified_with_api_keys_is_alerted(tmp_path, name, serving, controller, keys, fires):
    series = {f"release_checkpoint_signatures_verified{{{CONTROLLER}}}": controller}
    for instance, values in zip((SERVE_A, SERVE_B), serving, strict=True):
        series[f"serving_api_keys_configured{{{instance}}}"] = keys
        if values is not None:
            series[f"serving_release_signatures_verified{{{instance}}}"] = values
    expected = [{"exp_labels": {"severity": "ticket", "records": r},
                 "exp_annotations": {**_annotations("FlywheelRecordsNotVerified"),
                                     "summary": f"{r} records are read without verifying signatures in a deployment "
                                                "with API keys"}} for r in fires]
    done = _promtool(tmp_path, series, "25m", expected, alertname="FlywheelRecordsNotVerified")
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("name, serving, controller, fires", [
    ("every key file usable", "0x20", "0x20", []),
    ("a serving key file refused", "1x20", "0x20", ["release"]),
    ("a checkpoint key file refused", "0x20", "1x20", ["checkpoint"]),
    ("half written for a minute, then whole (a Secret update)", "1x1 0x19", "0x20", []),
])
def test_a_refused_key_file_is_alerted(tmp_path, name, serving, controller, fires):
    series = {f"serving_release_key_files_refused{{{SERVE_A}}}": serving,
              f"release_checkpoint_key_files_refused{{{CONTROLLER}}}": controller}
    expected = [{"exp_labels": {"severity": "ticket", "records": r},
                 "exp_annotations": {**_annotations("FlywheelKeyFileRefused"),
                                     "summary": f"A trusted {r} key file cannot be used; records signed with its key "
                                                "are refused"}} for r in fires]
    done = _promtool(tmp_path, series, "15m", expected, alertname="FlywheelKeyFileRefused")
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("component, port", [("serving", "serving-a:8000"), ("release", "release:8100")])
@pytest.mark.parametrize("per_minute, fires", [(30, False), (120, True)])
def test_connections_cut_past_one_a_second_ticket(tmp_path, component, port, per_minute, fires):
    """A client on a bad network now and then tickets nobody; a slow-loris attack (or a proxy whose
    clients share one address) cutting two a second for a quarter of an hour does."""
    series = {f'{component}_connections_cut_total{{job="flywheel-{component}", instance="{port}", '
              f'reason="header_timeout"}}': f"0+{per_minute}x40"}
    labels = {"severity": "ticket", "job": f"flywheel-{component}", "instance": port, "reason": "header_timeout"}
    expected = [{"exp_labels": labels, "exp_annotations": _annotations("FlywheelConnectionsCut")}]
    done = _promtool(tmp_path, series, "30m", expected if fires else [], alertname="FlywheelConnectionsCut")
    assert done.returncode == 0, f"{per_minute}/min: {done.stdout}{done.stderr}"


# -- two deployments in one Prometheus, scraped through the prometheus-operator's PodMonitors -----
# A PodMonitor's job is <namespace>/<PodMonitor name>, and every series carries its namespace
# (deploy/k8s/components/prometheus-operator).

def _pod(namespace: str, role: str, pod: str) -> str:
    return f'job="{namespace}/flywheel-{role}", namespace="{namespace}", pod="{pod}", instance="10.0.0.{len(pod)}:9101"'


TEAM_A_INGEST, TEAM_B_INGEST = _pod("team-a", "ingest", "ingest-a"), _pod("team-b", "ingest", "ingest-bb")
TEAM_A_RELEASE, TEAM_B_RELEASE = _pod("team-a", "release", "release-a"), _pod("team-b", "release", "release-bb")


def test_a_process_down_under_a_podmonitor_pages_with_its_namespace(tmp_path):
    """The compose-only job regex (flywheel-.+) never matched team-b/flywheel-ingest."""
    series = {f"up{{{TEAM_A_INGEST}}}": "1x10", f"up{{{TEAM_B_INGEST}}}": "0x10"}
    labels = {"severity": "page", **dict(kv.split("=") for kv in TEAM_B_INGEST.replace('"', "").split(", "))}
    expected = [{"exp_labels": labels, "exp_annotations": {
        "summary": f"Prometheus cannot scrape team-b/flywheel-ingest on {labels['instance']}",
        "runbook_url": _link("process-down.md")}}]
    done = _promtool(tmp_path, series, "9m", expected, alertname="FlywheelProcessDown")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name, team_b_release", [
    ("team-b's controllers hold no lease", {"up": "1x10", "release_lease_held": "0x10"}),
    ("team-b's controllers are gone, its ingest is still scraped", {}),
])
def test_one_namespaces_controller_does_not_mask_anothers_absence(tmp_path, name, team_b_release):
    """team-a's leader held max(release_lease_held) at 1 for the whole Prometheus: team-b's failing
    canaries went unjudged, and nobody was paged."""
    series = {f"up{{{TEAM_A_RELEASE}}}": "1x10", f"release_lease_held{{{TEAM_A_RELEASE}}}": "1x10",
              f"up{{{TEAM_A_INGEST}}}": "1x10", f"up{{{TEAM_B_INGEST}}}": "1x10",
              **{f"{metric}{{{TEAM_B_RELEASE}}}": values for metric, values in team_b_release.items()}}
    expected = [{"exp_labels": {"severity": "page", "namespace": "team-b"},
                 "exp_annotations": _annotations("FlywheelReleaseNoController")}]
    done = _promtool(tmp_path, series, "9m", expected, alertname="FlywheelReleaseNoController")
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


def test_one_namespaces_journal_pages_for_that_namespace_alone(tmp_path):
    """A page says which deployment is journaling; the other's empty journal does not hide it."""
    series = {f'serving_journal_depth_records{{{_pod("team-a", "serve", "serve-a")}}}': "0x10",
              f'serving_journal_depth_records{{{_pod("team-b", "serve", "serve-b")}}}': "40x10"}
    expected = [{"exp_labels": {"severity": "page", "namespace": "team-b"},
                 "exp_annotations": _annotations("FlywheelFeedbackJournaling")}]
    done = _promtool(tmp_path, series, "9m", expected, alertname="FlywheelFeedbackJournaling")
    assert done.returncode == 0, done.stdout + done.stderr


def test_feedback_in_one_namespace_does_not_hide_its_absence_in_another(tmp_path):
    requests = 'serving_requests_total{{{}, route="/v1/chat/completions", status="200"}}'
    series = {requests.format(_pod("team-a", "serve", "serve-a")): "0+60x150",
              requests.format(_pod("team-b", "serve", "serve-b")): "0+60x150",
              f'serving_feedback_total{{{_pod("team-a", "serve", "serve-a")}, signal="accept"}}': "0+10x150"}
    expected = [{"exp_labels": {"severity": "ticket", "namespace": "team-b"},
                 "exp_annotations": _annotations("FlywheelNoFeedback")}]
    done = _promtool(tmp_path, series, "150m", expected, alertname="FlywheelNoFeedback")
    assert done.returncode == 0, done.stdout + done.stderr
