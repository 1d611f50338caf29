"""Dashboards and rules stay true to the code: every metric they name is registered somewhere,
every alert has a runbook, and the generated dashboard is what the generator produces."""

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASH = ROOT / "dashboards"
STAGES = ("serving", "ingest", "reward", "trainer", "release")
METRIC = re.compile(r"(?<![:\w])((?:serving|ingest|reward|trainer|release)_[a-z0-9_]+)")
#: How an alert links its runbook: the deployment's external label, then the file's name.
RUNBOOK_URL = re.compile(r"\{\{ \$externalLabels\.runbooks_url \}\}/([a-z0-9-]+\.md)")


def _registered() -> set[str]:
    """Metric names as the code registers them (literal names, plus the per-stage bus helpers)."""
    names: set[str] = set()
    for pkg in (*STAGES, "flywheel"):
        for path in (ROOT / pkg).rglob("*.py"):
            names.update(re.findall(r'"((?:serving|ingest|reward|trainer|release)_[a-z0-9_]+)"', path.read_text()))
    for stage in ("ingest", "reward", "trainer"):  # flywheel/kafka/lag.py and flywheel/stream build these from the stage name
        names.update({f"{stage}_deadletters_total", f"{stage}_consumer_lag_records"})
    names.add("serving_deadletters_total")  # serving/follow.py's DeadLetters, named by its stage
    names.add("release_deadletters_total")  # release/streams.py's, likewise
    for stage in ("ingest", "reward"):  # flywheel/stream/runner.py builds these from the stage name
        names.update({f"{stage}_archive_queue_rows", f"{stage}_stalled_seconds", f"{stage}_outbox_rows"})
    return names | _connection_metrics()


def _code() -> str:
    return "\n".join(p.read_text() for pkg in (*STAGES, "flywheel") for p in (ROOT / pkg).rglob("*.py"))


def _connection_metrics() -> set[str]:
    """The connection metrics the code registers, by the code itself, for the components its call
    sites name: the APIs' guards (flywheel/connections.py ``count_in(registry, "<component>")``)
    and the ops ports (flywheel/metrics.py ``serve_ops(..., component=...)``: the trainer's by
    name, the stream stages' by their ``StageSpec`` name)."""
    from prometheus_client import CollectorRegistry

    from flywheel.connections import ConnectionGuard
    from flywheel.metrics import serve_ops
    from flywheel.probes import Probes
    from flywheel.settings import HttpSettings

    code = _code()
    apis = set(re.findall(r'count_in\(\s*\w+,\s*"(\w+)"\)', code))
    ops = set(re.findall(r'serve_ops\([^)]*component="(\w+)"', code))
    if "component=name" in (ROOT / "flywheel" / "stream" / "serve.py").read_text():
        ops |= set(re.findall(r'StageSpec\(\s*name="(\w+)"', code))
    # the call sites as the code has them: a pattern above that stopped matching fails here
    assert apis == {"serving", "release"} and ops >= {"ingest", "reward", "trainer"}, (apis, ops)
    registry = CollectorRegistry()
    for component in apis:
        ConnectionGuard(HttpSettings()).count_in(registry, component)
    def ok() -> tuple[bool, dict]:
        return True, {}

    for component in ops:
        server = serve_ops(registry, Probes(ok, ok), "127.0.0.1", 0, component=component)
        server.shutdown()
        server.server_close()
    return {sample.name for metric in registry.collect() for sample in metric.samples}


def test_the_slow_clients_runbooks_metrics_are_on_the_board():
    """The runbook has on-call read each API's open connections beside its cuts: the board shows both."""
    runbook = (DASH / "runbooks" / "slow-clients.md").read_text()
    assert "`<component>_connections_open`" in runbook
    board = {_base(m) for e in _board_exprs() for m in METRIC.findall(e)}
    for api in ("serving", "release"):
        assert {f"{api}_connections_open", f"{api}_connections_cut_total"} <= board, api


def _base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|created)$", "", name)


def _board_exprs() -> list[str]:
    dash = json.loads((DASH / "grafana" / "flywheel-overview.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _exprs() -> list[str]:
    out = _board_exprs()
    for f in (DASH / "prometheus").glob("*.yml"):
        for group in yaml.safe_load(f.read_text())["groups"]:
            out.extend(rule["expr"] for rule in group["rules"])
    return out


def test_every_metric_named_is_registered():
    registered = _registered()
    named = {_base(m) for e in _exprs() for m in METRIC.findall(e)}
    assert named, "no metric names found in dashboards"
    missing = sorted(m for m in named if m not in registered)
    assert not missing, f"dashboards/rules name metrics no code registers: {missing}"


def test_recorded_series_used_are_defined():
    defined = {
        r["record"]
        for g in yaml.safe_load((DASH / "prometheus" / "recording.yml").read_text())["groups"]
        for r in g["rules"]
    }
    used = {m for e in _exprs() for m in re.findall(r"\bflywheel:[a-z0-9_:]+", e)}
    assert used <= defined, f"undefined recording rules: {sorted(used - defined)}"


def test_every_alert_has_a_runbook():
    alerts = [
        r for g in yaml.safe_load((DASH / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    ]
    assert alerts
    for rule in alerts:
        # a link a pager opens, not a path in this repository (deploy/prometheus.yml sets the base)
        link = RUNBOOK_URL.fullmatch(rule["annotations"].get("runbook_url", ""))
        assert link, f"{rule['alert']}: runbook_url must be {RUNBOOK_URL.pattern}, not {rule['annotations']}"
        runbook = DASH / "runbooks" / link.group(1)
        assert runbook.is_file(), f"{rule['alert']}: runbook {runbook} missing"
        assert rule["labels"]["severity"] in {"page", "ticket"}
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert scrape["global"]["external_labels"]["runbooks_url"].startswith(("http://", "https://"))


def test_dashboard_is_generated(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboards", DASH / "build_dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = json.loads((DASH / "grafana" / "flywheel-overview.json").read_text())
    assert committed == mod.build(), "run dashboards/build_dashboards.py after editing panels"


def test_every_expression_is_valid_promql():
    import promql_parser

    bad = []
    for expr in _exprs():
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            bad.append(f"{expr.strip()!r}: {exc}")
    assert not bad, "\n".join(bad)


def test_every_deployed_scrape_job_is_watched_for_being_down():
    """FlywheelProcessDown selects jobs by a regex: a job added to the deployment under another
    name would never page when its process dies."""
    rules = {r["alert"]: r for g in yaml.safe_load((DASH / "prometheus" / "alerts.yml").read_text())["groups"]
             for r in g["rules"]}
    selector = re.fullmatch(r'up\{job=~"([^"]+)"\} == 0', rules["FlywheelProcessDown"]["expr"].strip())
    assert selector, rules["FlywheelProcessDown"]["expr"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = [j["job_name"] for j in scrape["scrape_configs"]]
    assert len(jobs) == 5  # serve, ingest, reward, trainer, release
    unwatched = [j for j in jobs if not re.fullmatch(selector.group(1), j)]
    assert not unwatched, f"scrape jobs FlywheelProcessDown does not cover: {unwatched}"
