"""The topic registry (flywheel/topology.py) and what is generated from it: the docs' tables and
the Strimzi component, held equal here; the drift judge table-tested. The broker side is
tests/integration/test_topics.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cli.main import build_parser
from flywheel import contracts, topology
from flywheel.contracts import Topics
from flywheel.kafka.topics import Difference, Found, judge
from flywheel.settings import KafkaSettings, Settings, load_settings
from flywheel.topology import Cleanup, PartitionRule, Role

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "deploy" / "k8s" / "components" / "strimzi-topics"


def test_every_topic_of_topics_is_declared_once_in_its_order():
    topology.check_registry()
    assert [t.name("p.") for t in topology.TOPICS] == list(Topics("p.").all())


def test_releases_and_checkpoints_are_compacted_and_have_one_partition():
    for name in ("releases", "checkpoints"):
        t = topology.spec(name)
        assert (t.cleanup, t.partitions, t.retention) == (Cleanup.COMPACT, PartitionRule.ONE, None), name


def test_topics_whose_records_share_a_key_are_never_compacted():
    # several feedback events per generation, every serving instance's reports per deployment,
    # several letters per source key: compaction would drop all but the last
    for name in ("feedback", "serving-status", "deadletter", "generations", "episodes", "rewards"):
        t = topology.spec(name)
        assert t.cleanup is Cleanup.DELETE and t.retention is not None and t.retention >= timedelta(days=7), name


def test_the_stage_topics_share_one_partition_count():
    # a generation, its feedback, episode and reward must land on the same partition number
    for name in ("generations", "feedback", "episodes", "rewards"):
        assert topology.spec(name).partitions is PartitionRule.STAGE, name


def test_every_role_named_is_real():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for r in topology.ROLES:
        command = re.match(r"`flywheel (\w+)", r.runs)
        assert command and command.group(1) in commands, r
        if r.group_section:
            assert getattr(Settings(), r.group_section).group_id
    roles = {r.role for r in topology.ROLES}
    assert roles == set(Role)
    for t in topology.TOPICS:
        assert t.producers and t.consumers and set(t.producers + t.consumers) <= roles, t.suffix
        assert t.signer is None or t.signer in t.producers, t.suffix
        assert isinstance(getattr(contracts, t.record), type), t.suffix  # a real wire type
    # the two records that move weights have one writer each, who signs them
    assert [(t.producers, t.signer) for t in map(topology.spec, ("checkpoints", "releases"))] == [
        ((Role.TRAINER,), Role.TRAINER), ((Role.RELEASE,), Role.RELEASE)]


@pytest.mark.parametrize(("rf", "partitions"), [(1, 2), (3, 4), (5, 12)])
def test_a_plan_takes_the_partitions_and_replication_factor_from_the_one_kafka_setting(rf, partitions):
    kafka = KafkaSettings(replication_factor=rf, partitions=partitions, max_request_bytes=9 << 20)
    for p in topology.plans("x.", kafka):
        assert p.replication_factor == rf
        assert p.partitions == (1 if p.spec.partitions is PartitionRule.ONE else partitions)
        assert p.configs["max.message.bytes"] == str(9 << 20)
        assert p.configs["cleanup.policy"] == p.spec.cleanup.value
        assert ("retention.ms" in p.configs) == (p.spec.cleanup is Cleanup.DELETE)


@pytest.mark.parametrize(("rf", "min_insync"), [(1, 1), (2, 1), (3, 2), (5, 2)])
def test_min_insync_replicas(rf, min_insync):
    assert topology.min_insync_replicas(rf) == min_insync


def test_the_serving_and_trainer_start_ups_make_their_own_topics():
    assert {t.suffix for t in topology.role_topics(Role.SERVING)} == {
        "generations", "feedback", "releases", "serving-status", "deadletter"}
    assert {t.suffix for t in topology.role_topics(Role.TRAINER)} == {"rewards", "checkpoints", "deadletter"}


_PLAN = topology.plan(topology.spec("releases"), "x.", KafkaSettings(replication_factor=3))
_AS_DECLARED = dict(_PLAN.configs)


@pytest.mark.parametrize(("partitions", "replicas", "configs", "found", "differences", "unknown"), [
    (1, 3, _AS_DECLARED, Found.AS_DECLARED, (), ()),
    (4, 3, _AS_DECLARED, Found.DRIFTED, (Difference("partitions", "1", "4"),), ()),
    (1, 1, _AS_DECLARED, Found.DRIFTED, (Difference("replication_factor", "3", "1"),), ()),
    (1, 3, _AS_DECLARED | {"cleanup.policy": "delete"}, Found.DRIFTED,
     (Difference("cleanup.policy", "compact", "delete"),), ()),
    # a broker that reports no configs (the embedded one): unknown, never drift
    (1, 3, {}, Found.AS_DECLARED, (), tuple(_AS_DECLARED)),
    (1, 3, {"cleanup.policy": "compact"}, Found.AS_DECLARED, (),
     tuple(k for k in _AS_DECLARED if k != "cleanup.policy")),
])
def test_judge(partitions, replicas, configs, found, differences, unknown):
    got = judge(_PLAN, partitions, replicas, configs)
    assert (got.found, got.differences, got.unknown) == (found, differences, unknown)


def _generated(doc: str) -> str:
    text = (ROOT / doc).read_text()
    m = re.search(r"<!-- generated: flywheel topics (\w+) -->\n(.*?)<!-- end generated -->", text, re.DOTALL)
    assert m, f"{doc} has lost its generated table's markers"
    return m.group(2)


def test_the_docs_topic_table_is_the_registry():
    assert _generated("docs/deploy.md") == topology.topic_table(), \
        "regenerate docs/deploy.md's table with `flywheel topics table`"


def test_the_docs_acl_table_is_the_registry():
    assert _generated("docs/signing.md") == topology.acl_table(), \
        "regenerate docs/signing.md's table with `flywheel topics acls`"


def _render(tmp_path: Path, overlay: str) -> list[dict]:
    """The overlay with the secured-Kafka and Strimzi components, as `kubectl kustomize` makes it."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the Strimzi component is rendered by kustomize itself")
    k8s = os.path.relpath(ROOT / "deploy" / "k8s", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{k8s}/overlays/{overlay}"],
        "components": [f"{k8s}/components/kafka-sasl-ssl", f"{k8s}/components/strimzi-topics"]}))
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if "value" in e}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_strimzi_component_is_the_registry_under_every_roles_settings(overlay, tmp_path):
    rendered = _render(tmp_path, overlay)
    deployments = [d for d in rendered if d["kind"] == "Deployment"]
    # every role makes missing topics with the same partitions and replication factor
    shapes = {}
    for d in deployments:
        shape = ("FLYWHEEL_KAFKA_PARTITIONS", "FLYWHEEL_KAFKA_REPLICATION_FACTOR", "FLYWHEEL_TOPIC_PREFIX")
        kafka = load_settings(env={k: v for k, v in _env(d).items() if k in shape},
                              config_file=ROOT / "deploy" / "k8s" / "base" / "flywheel.toml").kafka
        shapes[d["metadata"]["name"]] = (kafka.partitions, kafka.replication_factor)
    assert len(set(shapes.values())) == 1, f"the roles would make topics differently: {shapes}"
    ((partitions, rf),) = set(shapes.values())
    settings = Settings(kafka=KafkaSettings(partitions=partitions, replication_factor=rf))

    strimzi = [r for r in rendered if r["apiVersion"].startswith("kafka.strimzi.io/")]
    for r in strimzi:
        r["metadata"]["labels"].pop("app.kubernetes.io/part-of")  # the base's label, added by kustomize
    want = topology.strimzi_resources(settings, "kafka")
    for r in want:
        r["metadata"]["labels"].pop("app.kubernetes.io/part-of")
    by_name = lambda rs: sorted(rs, key=lambda r: (r["kind"], r["metadata"]["name"]))
    assert by_name(strimzi) == by_name(want)
    assert {(r["kind"], r["spec"]["topicName"] if r["kind"] == "KafkaTopic" else r["metadata"]["name"])
            for r in strimzi} >= {("KafkaTopic", "flywheel.releases"), ("KafkaUser", "flywheel-serving")}
    # the committed files are what the command makes
    for name, text in topology.strimzi_files(settings).items():
        assert (COMPONENT / name).read_text() == text, f"regenerate {name}: flywheel topics manifests"

    # each role logs in as its own principal: its username, and the password of its KafkaUser
    users = {r["metadata"]["name"] for r in strimzi if r["kind"] == "KafkaUser"}
    (principals,) = [r["data"] for r in rendered if r["metadata"]["name"] == topology.PRINCIPALS_CONFIGMAP]
    for d in deployments:
        (kafka_volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "kafka"]
        sources = kafka_volume["projected"]["sources"]
        (username,) = [principals[s["configMap"]["items"][0]["key"]] for s in sources if "configMap" in s]
        password = next(s["secret"]["name"] for s in sources
                        if "secret" in s and s["secret"]["items"][0]["key"] == "password")
        assert username == password == d["metadata"]["name"] and username in users, d["metadata"]["name"]
        assert "secret" not in kafka_volume  # the shared flywheel-kafka login is gone
    for r in rendered:  # what Kubernetes itself validates (Strimzi's kinds are its operator's)
        if not r["apiVersion"].startswith("kafka.strimzi.io/"):
            kubernetes_validate.validate(r, "1.37.0", strict=True)


def test_no_role_makes_topics_but_through_the_registry():
    # ensure_topics makes ad-hoc topics with kafka.partitions alike (tests, benches); a role that
    # called it would make checkpoints with the stage count and releases uncompacted
    offenders = []
    for package in ("serving", "ingest", "reward", "trainer", "release", "cli", "local", "flywheel"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() != "flywheel/kafka/clients.py" and "ensure_topics(" in path.read_text():
                offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == []


def test_the_architecture_docs_topics_carry_the_registrys_records_and_keys():
    # docs/architecture.md's contracts table is prose around the registry's facts: its record and
    # key columns must be the registry's
    rows = re.findall(r"^\| `flywheel\.([a-z-]+)` \| `(\w+)` \| ([^|]+?) \|", (ROOT / "docs" / "architecture.md")
                      .read_text(), re.MULTILINE)
    assert {name: (record, key) for name, record, key in rows} == {
        t.suffix: (t.record, t.key) for t in topology.TOPICS}
