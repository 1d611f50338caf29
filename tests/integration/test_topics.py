"""``flywheel topics`` and the roles' start-up creation against the session's real broker: topics
made as flywheel/topology.py declares them (read back from the broker's metadata), and drift
reported on a topic made otherwise. The embedded broker reports only the configs a topic was
made with, so a topic made with none shows them as unknown; tests/unit/test_topology.py holds
the judge's whole table."""

from __future__ import annotations

import json
import logging
import re
import uuid

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from prometheus_client import CollectorRegistry

from cli.main import main
from flywheel.contracts import Topics
from flywheel.kafka.topics import ensure_declared
from flywheel.settings import Settings
from flywheel.topology import TOPICS, PartitionRule, Role, role_topics
from release.streams import Streams


def _shapes(bootstrap: str, names) -> dict[str, int]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        return {d["name"]: len(d["partitions"]) for d in admin.describe_topics(sorted(names))
                if not d.get("error_code")}
    finally:
        admin.close()


def _declared(kafka_settings) -> dict[str, int]:
    return {t.suffix: 1 if t.partitions is PartitionRule.ONE else kafka_settings.partitions for t in TOPICS}


def _cleanup(bootstrap: str, names) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics(sorted(names))
    finally:
        admin.close()


def test_flywheel_topics_creates_the_declared_topics_then_reports_drift(kafka_settings, monkeypatch, capsys,
                                                                         caplog):
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", kafka_settings.bootstrap)
    monkeypatch.setenv("FLYWHEEL_TOPIC_PREFIX", topics.prefix)
    monkeypatch.setenv("FLYWHEEL_KAFKA_PARTITIONS", str(kafka_settings.partitions))
    try:
        assert main(["topics", "-o", "json"]) == 0
        body = json.loads(capsys.readouterr().out)
        assert body["topics"] == list(topics.all()) and body["drifted"] == 0
        assert {c["found"] for c in body["checks"]} == {"created"}
        shapes = _shapes(kafka_settings.bootstrap, topics.all())
        assert {n.removeprefix(topics.prefix): p for n, p in shapes.items()} == _declared(kafka_settings)
        assert shapes[topics.checkpoints] == shapes[topics.releases] == 1

        # checkpoints made by other means with the stage count and no configs, releases not
        # compacted: drift, exit 1
        _cleanup(kafka_settings.bootstrap, [topics.checkpoints, topics.releases])
        admin = KafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap)
        try:
            admin.create_topics([NewTopic(topics.checkpoints, 3, 1),
                                 NewTopic(topics.releases, 1, 1, topic_configs={"cleanup.policy": "delete"})])
        finally:
            admin.close()
        assert main(["topics", "-o", "json"]) == 1
        body = json.loads(capsys.readouterr().out)
        checks = {c["name"]: c for c in body["checks"]}
        assert body["drifted"] == 2
        assert checks[topics.checkpoints]["found"] == checks[topics.releases]["found"] == "drifted"
        assert checks[topics.checkpoints]["differences"] == [{"what": "partitions", "declared": "1", "actual": "3"}]
        assert checks[topics.releases]["differences"] == [
            {"what": "cleanup.policy", "declared": "compact", "actual": "delete"}]
        # the embedded broker reports only the configs a topic was made with: the rest unknown, not drift
        assert "cleanup.policy" in checks[topics.checkpoints]["unknown_configs"]
        assert {c["found"] for n, c in checks.items() if n not in (topics.checkpoints, topics.releases)} == {
            "as_declared"}
        assert checks[topics.generations]["unknown_configs"] == []

        assert main(["topics"]) == 1  # the table for a person says the same
        out = capsys.readouterr().out
        assert re.search(rf"{re.escape(topics.checkpoints)} +drifted .*partitions 3, declared 1", out), out

        # a role's start-up changes no existing topic, and says so
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flywheel.kafka.topics"):
            ensure_declared(kafka_settings, topics, role_topics(Role.TRAINER))
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            (f"topic {topics.checkpoints} has 3 partitions, flywheel/topology.py declares 1: `flywheel topics` "
            "reports every difference (docs/deploy.md, Topics)")]
        assert _shapes(kafka_settings.bootstrap, [topics.checkpoints]) == {topics.checkpoints: 3}
    finally:
        _cleanup(kafka_settings.bootstrap, topics.all())


def test_a_role_that_starts_first_makes_the_topics_as_declared(kafka_settings, tmp_path):
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    settings = Settings(kafka=kafka_settings, topic_prefix=topics.prefix, data_dir=tmp_path)
    streams = Streams(settings, CollectorRegistry())  # the release controller's Kafka side
    try:
        shapes = _shapes(kafka_settings.bootstrap, topics.all())
        assert {n.removeprefix(topics.prefix): p for n, p in shapes.items()} == _declared(kafka_settings)
    finally:
        streams.close()
        _cleanup(kafka_settings.bootstrap, topics.all())
