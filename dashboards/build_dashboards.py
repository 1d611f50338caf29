"""Generate the Grafana dashboard JSON from a short panel list, and the prometheus-operator's
PrometheusRule from the rule files (run: python dashboards/build_dashboards.py).

Panels are data here, so a new metric is one line, and tests/unit/test_dashboards.py checks every
metric a panel or rule names is one the code registers. The PrometheusRule
(deploy/k8s/components/prometheus-operator/rules.yaml) is prometheus/alerts.yml and
prometheus/recording.yml as one object, so a cluster's alerts are the ones promtool tests
(tests/unit/test_alert_rules.py); test_dashboards holds it equal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

HERE = Path(__file__).parent
RULE_FILES = (HERE / "prometheus" / "recording.yml", HERE / "prometheus" / "alerts.yml")
PROMETHEUS_RULE = HERE.parent / "deploy" / "k8s" / "components" / "prometheus-operator" / "rules.yaml"


def _by_engine(q: float, histogram: str) -> str:
    """The ``q`` quantile of an engine histogram per engine and version, over every replica."""
    return f"histogram_quantile({q}, sum by (le, engine, version) (rate({histogram}_bucket[5m])))"


# (row title, [(panel title, unit, [(expr, legend)])])
ROWS = [
    ("Processes", [
        ("Processes up by job, of their scrape targets", "short", [
            ('sum by (job) (up{job=~"(.+/)?flywheel-.+"})', "{{job}} up"),
            ('count by (job) (up{job=~"(.+/)?flywheel-.+"})', "{{job}} targets")]),
    ]),
    ("Serving", [
        ("Requests/s by route and status", "reqps", [
            ('sum by (route, status) (rate(serving_requests_total[5m]))', "{{route}} {{status}}")]),
        ("p50 / p99 latency", "s", [
            ('histogram_quantile(0.5, sum by (le) (rate(serving_request_latency_seconds_bucket[5m])))', "p50"),
            ('histogram_quantile(0.99, sum by (le) (rate(serving_request_latency_seconds_bucket[5m])))', "p99")]),
        ("Tokens/s by model version", "short", [
            ('sum by (model_version) (rate(serving_generated_tokens_total[5m]))', "v{{model_version}}")]),
        ("Feedback/s by signal", "short", [
            ('sum by (signal) (rate(serving_feedback_total[5m]))', "{{signal}}")]),
        ("Accept rate", "percentunit", [
            ('flywheel:feedback_accept_ratio:rate15m', "accept / (accept + reject + edit)")]),
        ("Version each route serves (-1: off), and the canary's share", "short", [
            ('max by (route) (serving_route_version)', "{{route}}"),
            ('max(serving_canary_share)', "canary share")]),
        ("Requests/s by route (stable, canary, pinned)", "reqps", [
            ('sum by (route) (rate(serving_routed_requests_total[5m]))', "{{route}}")]),
        ("Weight swaps and refused versions", "short", [
            ('sum by (outcome) (increase(serving_swaps_total[15m]))', "swaps {{outcome}}"),
            ('sum by (reason) (increase(serving_versions_refused_total[15m]))', "refused {{reason}}")]),
        ("Release record to version answering, p95 by phase; swap pause p95", "s", [
            ('histogram_quantile(0.95, sum by (le, phase) (rate(serving_release_phase_seconds_bucket[1h])))', "{{phase}}"),
            ('histogram_quantile(0.95, sum by (le) (rate(serving_swap_seconds_bucket[1h])))', "swap pause")]),
        ("Recording: journal depth and failures", "short", [
            ('sum(serving_journal_depth_records)', "journal records"),
            ('sum(rate(serving_publish_failures_total[5m]))', "publish failures/s"),
            ('sum(rate(serving_dropped_events_total[5m]))', "dropped/s")]),
        # whether the records that choose weights are verified (docs/signing.md): 0 is signing off
        ("Signatures: verified (1) or not, trusted keys, key files refused", "short", [
            ('min(serving_release_signatures_verified)', "serving verifies releases"),
            ('min(release_checkpoint_signatures_verified)', "controller verifies checkpoints"),
            ('max(serving_release_trusted_keys)', "release keys trusted"),
            ('max(release_checkpoint_trusted_keys)', "checkpoint keys trusted"),
            ('(max(serving_release_key_files_refused) or vector(0)) + (max(release_checkpoint_key_files_refused) or vector(0))',
             "key files refused")]),
        # what runbooks/slow-clients.md has on-call read beside FlywheelConnectionsCut
        # (flywheel/connections.py): the connections held against the http caps, and the cuts
        ("API connections open per replica, and cut/s by reason", "short", [
            ('max by (job) (serving_connections_open)', "serving open (max replica)"),
            ('max by (job) (release_connections_open)', "release API open (max replica)"),
            ('sum by (reason) (rate(serving_connections_cut_total[5m]))', "serving cut {{reason}}/s"),
            ('sum by (reason) (rate(release_connections_cut_total[5m]))', "release API cut {{reason}}/s")]),
    ]),
    # vLLM's own statistics per engine (slot) and the version it served (serving/engine_stats.py)
    ("Engines", [
        ("Time to first token p50 / p99 by engine and version", "s", [
            (_by_engine(0.5, "serving_engine_time_to_first_token_seconds"), "p50 engine {{engine}} v{{version}}"),
            (_by_engine(0.99, "serving_engine_time_to_first_token_seconds"), "p99 engine {{engine}} v{{version}}")]),
        ("Inter-token latency (time per output token) p50 / p99", "s", [
            (_by_engine(0.5, "serving_engine_inter_token_latency_seconds"), "p50 engine {{engine}} v{{version}}"),
            (_by_engine(0.99, "serving_engine_inter_token_latency_seconds"), "p99 engine {{engine}} v{{version}}")]),
        ("Requests waiting (queue) and running by engine", "short", [
            ('sum by (engine, version) (serving_engine_requests_waiting)', "waiting engine {{engine}} v{{version}}"),
            ('sum by (engine, version) (serving_engine_requests_running)', "running engine {{engine}} v{{version}}")]),
        ("KV-cache use by engine (busiest replica)", "percentunit", [
            ('max by (engine, version) (serving_engine_kv_cache_usage_ratio)', "engine {{engine}} v{{version}}")]),
    ]),
    ("Ingest and reward", [
        ("Consumer lag by stage, topic and partition", "short", [
            ('ingest_consumer_lag_records', "ingest {{topic}}/{{partition}}"),
            ('reward_consumer_lag_records', "reward {{topic}}/{{partition}}"),
            ('trainer_consumer_lag_records', "trainer {{topic}}/{{partition}}")]),
        ("Episodes/s by signal", "short", [
            ('sum by (signal) (rate(ingest_episodes_total[5m]))', "{{signal}}")]),
        ("Join window occupancy", "short", [
            ('sum by (kind) (ingest_window_open_records)', "{{kind}}")]),
        ("Dead letters/s by stage and reason", "short", [
            ('sum by (reason) (rate(ingest_deadletters_total[5m]))', "ingest {{reason}}"),
            ('sum by (reason) (rate(reward_deadletters_total[5m]))', "reward {{reason}}"),
            ('sum by (reason) (rate(trainer_deadletters_total[5m]))', "trainer {{reason}}")]),
        ("Reward guard actions/s", "short", [
            ('sum by (flag) (rate(reward_guard_actions_total[5m]))', "{{flag}}")]),
        ("Reward p50 by signal", "short", [
            ('histogram_quantile(0.5, sum by (le, signal) (rate(reward_value_reward_bucket[15m])))', "{{signal}}")]),
        ("Archive queue: rows not yet in Parquet", "short", [
            ('sum(ingest_archive_queue_rows)', "episodes"), ('sum(reward_archive_queue_rows)', "rewards")]),
        ("Outbox: records owed to Kafka (input pauses at 200k)", "short", [
            ('sum(ingest_outbox_rows)', "ingest"), ('sum(reward_outbox_rows)', "reward")]),
        ("Seconds without progress with Kafka, the state database or the checkpoint store (0: fine)", "s", [
            ('max(ingest_stalled_seconds)', "ingest"), ('max(reward_stalled_seconds)', "reward"),
            ('max(trainer_stalled_seconds)', "trainer"), ('max(release_stalled_seconds)', "release")]),
    ]),
    ("Release", [
        ("Candidates by state", "short", [
            ('max by (state) (release_candidates)', "{{state}}")]),
        ("Live canary: e-values (a verdict at 1/alpha, 20 at the default)", "short", [
            ('max by (direction) (release_canary_e_value)', "canary {{direction}}")]),
        ("Live canary: confidence band on its win share (0.5: no difference)", "percentunit", [
            ('max by (bound) (release_canary_band)', "{{bound}}")]),
        ("Live canary: accept rate and outcomes by arm", "short", [
            ('max by (arm) (release_canary_accept_rate)', "accept rate {{arm}}"),
            ('max by (arm) (release_canary_outcomes)', "outcomes {{arm}}"),
            ('max by (arm) (release_canary_accepts)', "accepts {{arm}}")]),
        ("Live canary: users by arm, and the sample-ratio e-value (held for a person at 1,000)", "short", [
            ('max by (arm) (release_canary_users)', "users {{arm}}"),
            ('max(release_canary_sample_ratio_e_value)', "sample-ratio e-value")]),
        ("Seconds in state: canary, awaiting approval, held", "s", [
            ('max by (state) (release_state_seconds)', "{{state}}")]),
        ("Decisions per hour by outcome and actor", "short", [
            ('sum by (outcome, actor_kind) (increase(release_decisions_total[1h]))', "{{outcome}} by {{actor_kind}}")]),
        ("Gate: p95 duration and verdicts per hour", "short", [
            ('histogram_quantile(0.95, sum by (le) (rate(release_gate_seconds_bucket[6h])))', "p95 seconds"),
            ('sum by (outcome) (increase(release_gate_verdicts_total[1h]))', "{{outcome}}")]),
        ("Routing revision: decided, published (broker-acked), applied by serving; serving's refusals", "short", [
            ('max by (phase) (release_routing_revision)', "{{phase}}"),
            ('max(release_serving_revision_applied)', "applied by serving"),
            ('sum by (action) (increase(release_serving_refusals_total[1h]))', "refused: {{action}}/h")]),
        ("Lease held (1 per deployment), database up, webhooks", "short", [
            ('sum(release_lease_held)', "replicas holding the lease"),
            ('min(release_database_up)', "database up"),
            ('sum by (outcome) (increase(release_webhook_deliveries_total[1h]))', "webhooks {{outcome}}/h")]),
    ]),
    ("Trainer", [
        ("Loss and mean reward", "short", [
            ('trainer_loss_value', "loss"), ('trainer_reward_mean', "reward mean")]),
        ("Collapse signals: entropy and distinct completions", "short", [
            ('trainer_entropy_nats', "entropy (nats/token)"),
            ('trainer_distinct_completions_ratio', "distinct completions")]),
        ("KL to reference and logprob gap", "short", [
            ('trainer_kl_nats', "KL (nats/token)"), ('trainer_logprob_gap_nats', "trainer-behaviour gap")]),
        ("Importance ratio and clipping", "short", [
            ('trainer_importance_ratio', "ratio {{stat}}"), ('trainer_clip_ratio', "clipped"),
            ('trainer_tis_truncated_ratio', "TIS truncated")]),
        ("Samples/s and drops by reason", "short", [
            ('rate(trainer_samples_total[5m])', "trained/s"),
            ('sum by (reason) (rate(trainer_dropped_total[5m]))', "dropped {{reason}}")]),
        ("Data-wait fraction", "percentunit", [
            ('flywheel:trainer_data_wait_ratio:rate5m', "waiting for data")]),
        ("Version and delta compression", "short", [
            ('trainer_version', "version"), ('trainer_delta_compression_ratio', "delta ratio (x)")]),
        ("Step time p50", "s", [
            ('histogram_quantile(0.5, sum by (le) (rate(trainer_step_seconds_bucket[5m])))', "p50 step")]),
    ]),
]


#: A series the board reads: ``up``, a recorded ratio, or a metric a component registers, with its
#: matchers if it has any.
_SELECTOR = re.compile(r"\b(up|flywheel:[a-z0-9_:]+|(?:serving|ingest|reward|trainer|release)_[a-z0-9_]+)(\{[^}]*\})?")
#: The board's deployment: one Prometheus may scrape several (a namespace each, through the
#: prometheus-operator component's PodMonitors). ``.*`` (All) also matches compose's series, which
#: have no namespace.
NAMESPACE = 'namespace=~"$namespace"'


def scoped(expr: str) -> str:
    """``expr`` with every series it reads limited to the chosen namespace."""
    def one(m: re.Match[str]) -> str:
        inner = (m.group(2) or "{}")[1:-1]
        return m.group(1) + "{" + NAMESPACE + (", " + inner if inner else "") + "}"
    return _SELECTOR.sub(one, expr)


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "collapsed": False})
        pid, y = pid + 1, y + 1
        for i, (ptitle, unit, targets) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": ptitle, "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"expr": scoped(e), "legendFormat": l, "refId": chr(65 + k)}
                            for k, (e, l) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "title": "Flywheel overview", "uid": "flywheel-overview", "schemaVersion": 39, "version": 1,
        "tags": ["flywheel"], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "namespace", "label": "Deployment (namespace)", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": 'label_values(up{job=~"(.+/)?flywheel-.+"}, namespace)', "refId": "namespace"},
             "definition": 'label_values(up{job=~"(.+/)?flywheel-.+"}, namespace)', "refresh": 2,
             "includeAll": True, "allValue": ".*", "multi": False,
             "current": {"selected": True, "text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


def prometheus_rule() -> str:
    """The rule files' groups as one PrometheusRule (monitoring.coreos.com/v1), in YAML."""
    groups = [g for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "flywheel", "labels": {"app.kubernetes.io/name": "flywheel"}},
            "spec": {"groups": groups}}
    head = ("# Generated by dashboards/build_dashboards.py from dashboards/prometheus/*.yml: edit those\n"
            "# and run it again (tests/unit/test_dashboards.py holds this file equal to them).\n")
    return head + yaml.dump(rule, Dumper=_Block, sort_keys=False, width=200, allow_unicode=True)


class _Block(yaml.SafeDumper):
    """Multi-line expressions as ``|`` blocks, as the rule files write them, so they read the same."""


_Block.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


if __name__ == "__main__":
    out = HERE / "grafana" / "flywheel-overview.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
    PROMETHEUS_RULE.write_text(prometheus_rule())
    print(f"wrote {PROMETHEUS_RULE}")
