"""The prometheus-operator and network-policy components, as ``kubectl kustomize`` renders them.

PodMonitors, PrometheusRule and KafkaTopic are CRDs, outside the Kubernetes schemas that
``kubernetes-validate`` carries, so their required fields are checked here; the NetworkPolicies
are validated against the schemas and then judged flow by flow with the semantics of
networking.k8s.io/v1 (a pod selected by a policy of a direction admits only what one of those
policies' rules allows; kubelet probes are outside them). The alerts' job matcher is held to the
PodMonitors' job labels (``<namespace>/<PodMonitor name>``) and to compose's scrape jobs.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPONENTS = ("prometheus-operator", "network-policy")
NS = "flywheel"  # the namespace the deployment is applied to, in these flows


def _kustomize(folder: Path, overlay: str = "cpu", components: tuple[str, ...] = COMPONENTS,
               patches: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: components are rendered by kustomize itself")
    k8s = os.path.relpath(K8S, folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{k8s}/overlays/{overlay}"],
        "components": [f"{k8s}/components/{c}" for c in components], "patches": patches or []}))
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict[str, Any]]:
    return _kustomize(tmp_path_factory.mktemp("overlay"))


def _of(resources: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in resources if r["kind"] == kind]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's verdict on a set of labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _pods(resources: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each role's pod: its labels and its named container ports."""
    pods = {}
    for d in _of(resources, "Deployment"):
        tpl = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        pods[tpl["metadata"]["labels"]["app.kubernetes.io/component"]] = {
            "labels": tpl["metadata"]["labels"], "ports": ports, "namespace": NS}
    return pods


# -- PodMonitors and the PrometheusRule -----------------------------------------------------------

def test_a_podmonitor_scrapes_each_role_on_its_metrics_port_never_on_servings_api(rendered):
    pods, monitors = _pods(rendered), _of(rendered, "PodMonitor")
    assert sorted(pods) == ["ingest", "release", "reward", "serving", "trainer"]
    for m in monitors:  # the CRD's required fields
        assert m["apiVersion"] == "monitoring.coreos.com/v1" and m["metadata"]["name"]
        assert m["spec"]["selector"] and m["spec"]["podMetricsEndpoints"]
    for role, pod in pods.items():
        mine = [m for m in monitors if _selects(m["spec"]["selector"], pod["labels"])]
        assert len(mine) == 1, f"{role}: {len(mine)} PodMonitors select its pods"
        for ep in mine[0]["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in pod["ports"], f"{role}: no container port named {ep['port']}"
            assert ep.get("path", "/metrics") == "/metrics"
    serving_api = {p["targetPort"] for s in _of(rendered, "Service") if s["metadata"]["name"] == "flywheel-serving"
                   for p in s["spec"]["ports"]}
    serving_monitor = next(m for m in monitors if _selects(m["spec"]["selector"], pods["serving"]["labels"]))
    assert {ep["port"] for ep in serving_monitor["spec"]["podMetricsEndpoints"]}.isdisjoint(serving_api)


def test_process_down_watches_every_podmonitor_job_and_every_compose_job(rendered):
    rules = {r["alert"]: r for g in yaml.safe_load((ROOT / "dashboards/prometheus/alerts.yml").read_text())["groups"]
             for r in g["rules"] if "alert" in r}
    selector = re.fullmatch(r'up\{job=~"([^"]+)"\} == 0', rules["FlywheelProcessDown"]["expr"].strip())
    assert selector, rules["FlywheelProcessDown"]["expr"]
    compose = [j["job_name"] for j in yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]]
    # a PodMonitor's job is <namespace>/<its name>; its name is compose's job, so a dashboard's
    # legend reads the same under both
    operator = [f"team-a/{m['metadata']['name']}" for m in _of(rendered, "PodMonitor")]
    assert sorted(j.split("/")[1] for j in operator) == sorted(compose)
    unwatched = [j for j in compose + operator if not re.fullmatch(selector.group(1), j)]
    assert not unwatched, f"jobs FlywheelProcessDown does not cover: {unwatched}"


def test_the_prometheus_rule_is_generated_from_the_rule_files(rendered):
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "dashboards" / "build_dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.PROMETHEUS_RULE.read_text() == mod.prometheus_rule(), "run dashboards/build_dashboards.py"
    [rule] = _of(rendered, "PrometheusRule")
    files = [g for f in ("recording.yml", "alerts.yml")
             for g in yaml.safe_load((ROOT / "dashboards" / "prometheus" / f).read_text())["groups"]]
    assert rule["spec"]["groups"] == files
    for group in rule["spec"]["groups"]:  # the CRD's required fields
        assert group["name"] and group["rules"]
        assert all(r["expr"] and ("alert" in r) != ("record" in r) for r in group["rules"])


# -- NetworkPolicies ------------------------------------------------------------------------------

def test_every_network_policy_is_valid_kubernetes(rendered):
    policies = _of(rendered, "NetworkPolicy")
    assert len(policies) >= 5
    for res in rendered:
        if not res["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(res, "1.37.0", strict=True)


def _peer(peer: dict[str, Any], src: dict[str, Any]) -> bool:
    if "ipBlock" in peer:
        if "ip" not in src:
            return False
        ip = ipaddress.ip_address(src["ip"])
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if "ip" in src:
        return False
    ns_ok = (_selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src["namespace"]})
             if "namespaceSelector" in peer else src["namespace"] == NS)
    return ns_ok and _selects(peer.get("podSelector", {}), src.get("labels", {}))


def _ports(rule: dict[str, Any], pod: dict[str, Any], port: int, protocol: str) -> bool:
    if "ports" not in rule:
        return True
    for p in rule["ports"]:
        number = pod.get("ports", {}).get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if p.get("protocol", "TCP") == protocol and number == port:
            return True
    return False


def _admits(policies: list[dict[str, Any]], kind: str, pod: dict[str, Any], peer: dict[str, Any],
            port_pod: dict[str, Any], port: int, protocol: str) -> bool:
    """Whether ``pod`` (in NS) lets traffic in (kind Ingress, from ``peer``) or out (Egress, to it)."""
    mine = [p for p in policies if kind in p["spec"].get("policyTypes", ["Ingress"])
            and _selects(p["spec"]["podSelector"], pod["labels"])]
    if not mine:
        return True
    key, side = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    return any(_ports(rule, port_pod, port, protocol) and ("from" not in rule and "to" not in rule
                                                          or any(_peer(x, peer) for x in rule[side]))
               for p in mine for rule in p["spec"].get(key, []))


def _flow(policies, pods, src: str | dict[str, Any], dst: str | dict[str, Any], port: int | str,
          protocol: str = "TCP") -> bool:
    """Whether ``src`` reaches ``dst`` on ``port`` (a number, or the name of a port of dst's pod):
    a role name is its pod in NS; anything else is a dict (namespace and labels, or an ip)."""
    source = pods[src] if isinstance(src, str) else src
    target = pods[dst] if isinstance(dst, str) else dst
    number = target["ports"][port] if isinstance(port, str) else port
    out = not isinstance(src, str) or _admits(policies, "Egress", source, target, target, number, protocol)
    into = not isinstance(dst, str) or _admits(policies, "Ingress", target, source, target, number, protocol)
    return out and into


PRODUCT, ENGINEERS, MONITORING = ({"namespace": n, "labels": {}} for n in ("product", "release-engineers",
                                                                           "monitoring"))
OTHER = {"namespace": "someone-else", "labels": {}}
KAFKA = {"namespace": "kafka", "labels": {"strimzi.io/kind": "Kafka"}, "ports": {}}
POSTGRES = {"namespace": "postgresql", "labels": {"app": "postgresql"}, "ports": {}}
DNS = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": {}}
INTERNET, INTERNAL = {"ip": "203.0.113.5", "ports": {}}, {"ip": "10.1.2.3", "ports": {}}


@pytest.mark.parametrize("src, dst, port, allowed", [
    (PRODUCT, "serving", "http", True),  # the product calls the API
    (PRODUCT, "serving", "metrics", False),  # but reads no metrics
    (PRODUCT, "release", "http", False),
    (OTHER, "serving", "http", False),
    (ENGINEERS, "release", "http", True),  # the console and API
    (ENGINEERS, "serving", "http", False),
    (MONITORING, "serving", "metrics", True),
    (MONITORING, "serving", "http", False),  # Prometheus never on the product's port
    (MONITORING, "ingest", "ops", True), (MONITORING, "reward", "ops", True), (MONITORING, "trainer", "ops", True),
    (MONITORING, "release", "http", True),
    (OTHER, "ingest", "ops", False),
    ("ingest", "serving", "http", False),  # no role calls another over HTTP
    ("serving", KAFKA, 9092, True), ("ingest", KAFKA, 9093, True), ("trainer", KAFKA, 9092, True),
    ("release", KAFKA, 9092, True), ("reward", KAFKA, 9092, True),
    ("serving", KAFKA, 5432, False),
    ("ingest", POSTGRES, 5432, True), ("reward", POSTGRES, 5432, True), ("release", POSTGRES, 5432, True),
    ("serving", POSTGRES, 5432, False), ("trainer", POSTGRES, 5432, False),
    ("serving", DNS, 53, True), ("trainer", OTHER | {"ports": {}}, 53, False),
    ("release", INTERNET, 443, True),  # decision webhooks
    ("release", INTERNAL, 443, False), ("serving", INTERNET, 443, False),
])
def test_network_policies_allow_exactly_the_flows_of_the_deployment(rendered, src, dst, port, allowed):
    policies, pods = _of(rendered, "NetworkPolicy"), _pods(rendered)
    assert _flow(policies, pods, src, dst, port) is allowed
    if dst is DNS:
        assert _flow(policies, pods, src, dst, port, "UDP") is allowed


def test_the_flow_judge_can_refuse_and_the_default_deny_holds(rendered):
    """Without the component nothing is judged (every flow passes); with only the default deny,
    nothing passes: the table above is the policies' doing."""
    pods = _pods(rendered)
    deny = [p for p in _of(rendered, "NetworkPolicy") if p["metadata"]["name"] == "flywheel-default-deny"]
    assert _flow([], pods, PRODUCT, "serving", "http") and _flow([], pods, PRODUCT, "serving", "metrics")
    assert not _flow(deny, pods, PRODUCT, "serving", "http") and not _flow(deny, pods, "ingest", KAFKA, 9092)


def test_the_allowed_namespaces_are_an_overlays_patch(tmp_path):
    """docs/deploy.md's patch: the product in namespace shop, Prometheus in observability."""
    patches = [
        {"target": {"kind": "NetworkPolicy", "name": "flywheel-serving-api"}, "patch": yaml.safe_dump([
            {"op": "replace", "path": "/spec/ingress/0/from/0/namespaceSelector/matchLabels/kubernetes.io~1metadata.name",
             "value": "shop"}])},
        {"target": {"kind": "NetworkPolicy", "name": "flywheel-metrics"}, "patch": yaml.safe_dump([
            {"op": "replace", "path": "/spec/ingress/0/from/0/namespaceSelector/matchLabels/kubernetes.io~1metadata.name",
             "value": "observability"}])},
    ]
    rendered = _kustomize(tmp_path, patches=patches)
    policies, pods = _of(rendered, "NetworkPolicy"), _pods(rendered)
    shop, observability = {"namespace": "shop", "labels": {}}, {"namespace": "observability", "labels": {}}
    assert _flow(policies, pods, shop, "serving", "http") and not _flow(policies, pods, PRODUCT, "serving", "http")
    assert _flow(policies, pods, observability, "ingest", "ops")
    assert not _flow(policies, pods, MONITORING, "ingest", "ops")


# -- the board: one deployment at a time ----------------------------------------------------------

def _board() -> dict[str, Any]:
    import json

    return json.loads((ROOT / "dashboards" / "grafana" / "flywheel-overview.json").read_text())


def _selectors(node: Any) -> list[Any]:
    """Every vector selector of a parsed PromQL expression (promql_parser's tree)."""
    import promql_parser

    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    children = [getattr(node, a) for a in ("lhs", "rhs", "expr", "param") if hasattr(node, a)]
    children += list(getattr(node, "args", None) or [])
    return [s for c in children if c is not None for s in _selectors(c)]


def test_every_panel_reads_the_chosen_namespace_only():
    import promql_parser

    variables = {v["name"]: v for v in _board()["templating"]["list"]}
    assert variables["namespace"]["includeAll"] and variables["namespace"]["allValue"] == ".*"
    unscoped = []
    for panel in _board()["panels"]:
        for target in panel.get("targets", []):
            for sel in _selectors(promql_parser.parse(target["expr"])):
                if ("namespace", "$namespace") not in {(m.name, m.value) for m in sel.matchers.matchers}:
                    unscoped.append(f"{panel['title']}: {target['expr']}")
    assert not unscoped, "\n".join(unscoped)


@pytest.mark.parametrize("chosen, jobs", [
    ("team-b", {"team-b/flywheel-ingest": 0}),  # team-a's healthy ingest does not show
    (".*", {"team-a/flywheel-ingest": 1, "team-b/flywheel-ingest": 0, "flywheel-ingest": 1}),  # All, compose's too
])
def test_the_processes_panel_under_prometheus_shows_the_chosen_deployment(tmp_path, chosen, jobs):
    """The board's first panel, evaluated by Prometheus' engine (promtool) with the variable as
    Grafana substitutes it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    expr = next(t["expr"] for p in _board()["panels"] if p["title"].startswith("Processes up")
                for t in p["targets"] if t["refId"] == "A").replace("$namespace", chosen)
    series = {'up{job="team-a/flywheel-ingest", namespace="team-a", instance="10.0.0.1:9101"}': "1x5",
              'up{job="team-b/flywheel-ingest", namespace="team-b", instance="10.0.0.2:9101"}': "0x5",
              'up{job="flywheel-ingest", instance="ingest-a:9101"}': "1x5"}
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": [{"expr": expr, "eval_time": "3m", "exp_samples": [
            {"labels": f'{{job="{job}"}}', "value": value} for job, value in jobs.items()]}]}]}
    path = tmp_path / "board_test.yml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
