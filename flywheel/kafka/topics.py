"""The declared topics (flywheel/topology.py) made on a broker, and checked against it.

:func:`ensure_declared` is every role's start-up creation: it creates what is missing exactly as
the registry says, and warns about an existing topic whose partition count differs (read from
metadata, which every principal may describe). :func:`check_topics` is ``flywheel topics``:
the same creation, then each topic judged whole (partitions, replicas, configs) by :func:`judge`.
A config the broker does not report (the embedded development broker reports only those a topic
was made with) is "unknown", never drift.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import KafkaTimeoutError, TopicAlreadyExistsError

from flywheel.contracts import Topics
from flywheel.kafka.security import check_access, kafka_python_options
from flywheel.settings import KafkaSettings
from flywheel.topology import TOPICS, TopicPlan, TopicSpec, plans

log = logging.getLogger(__name__)


class Found(StrEnum):
    """What ``flywheel topics`` found of a declared topic."""

    CREATED = "created"  # it was missing, and is now made as declared
    AS_DECLARED = "as_declared"  # everything the broker reports matches
    DRIFTED = "drifted"  # something the broker reports differs: see the differences


@dataclass(frozen=True)
class Difference:
    """One way an existing topic differs from its declaration."""

    what: str  # "partitions", "replication_factor", or a config name
    declared: str
    actual: str


@dataclass(frozen=True)
class TopicCheck:
    name: str
    found: Found
    partitions: int
    replication_factor: int
    differences: tuple[Difference, ...] = ()
    #: Declared configs the broker did not report (it answered DescribeConfigs without them).
    unknown: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "found": self.found.value, "partitions": self.partitions,
                "replication_factor": self.replication_factor, "unknown_configs": list(self.unknown),
                "differences": [{"what": d.what, "declared": d.declared, "actual": d.actual}
                                for d in self.differences]}


def judge(p: TopicPlan, partitions: int, replicas: int, configs: Mapping[str, str]) -> TopicCheck:
    """An existing topic against its plan (pure). ``configs``: what the broker reported; a
    declared config it left out is unknown, not drift."""
    diffs = []
    if partitions != p.partitions:
        diffs.append(Difference("partitions", str(p.partitions), str(partitions)))
    if replicas != p.replication_factor:
        diffs.append(Difference("replication_factor", str(p.replication_factor), str(replicas)))
    unknown = []
    for key, want in p.configs.items():
        if key not in configs or configs[key] is None:
            unknown.append(key)
        elif str(configs[key]) != want:
            diffs.append(Difference(key, want, str(configs[key])))
    return TopicCheck(p.name, Found.DRIFTED if diffs else Found.AS_DECLARED, partitions, replicas,
                      tuple(diffs), tuple(unknown))


def _admin(cfg: KafkaSettings) -> KafkaAdminClient:
    # The first broker call of every role: check the security settings first, so a wrong password
    # or CA is named (flywheel/kafka/security.py) instead of the admin client's retrying until
    # its timeout; and the configured request timeout, not kafka-python's 30 s.
    if not check_access(cfg, timeout_s=cfg.request_timeout_ms / 1000):
        raise KafkaTimeoutError(f"no broker of kafka.bootstrap={cfg.bootstrap} answered in {cfg.request_timeout_ms} ms")
    return KafkaAdminClient(**kafka_python_options(cfg), client_id=f"{cfg.client_id}-admin",
                            request_timeout_ms=cfg.request_timeout_ms, bootstrap_timeout_ms=cfg.request_timeout_ms)


def _create(admin: KafkaAdminClient, missing: list[TopicPlan]) -> None:
    if not missing:
        return
    try:
        admin.create_topics([NewTopic(p.name, p.partitions, p.replication_factor, topic_configs=dict(p.configs))
                             for p in missing])
    except TopicAlreadyExistsError:
        pass  # another role won the race: it made them from the same registry
    log.info("created topics %s", [f"{p.name} ({p.partitions} partitions, rf {p.replication_factor}, "
                                   f"{p.configs['cleanup.policy']})" for p in missing])


def _shapes(admin: KafkaAdminClient, names: list[str]) -> dict[str, tuple[int, int]]:
    """Each topic's partition count and replication factor, from metadata."""
    out = {}
    for d in admin.describe_topics(names):
        if not d.get("error_code") and d.get("partitions"):
            out[d["name"]] = (len(d["partitions"]), len(d["partitions"][0].get("replica_nodes") or ()))
    return out


def _declared(topics: Topics, kafka: KafkaSettings, specs: Iterable[TopicSpec] | None) -> list[TopicPlan]:
    return list(plans(topics.prefix, kafka, tuple(specs) if specs is not None else TOPICS))


def ensure_declared(kafka: KafkaSettings, topics: Topics, specs: Iterable[TopicSpec] | None = None) -> None:
    """Create the declared topics (all, or ``specs``: a role's own) that are missing, as the
    registry says; warn about an existing one whose partition count differs from it.

    Every role calls this at start, so whichever starts first makes the same topics."""
    declared = _declared(topics, kafka, specs)
    admin = _admin(kafka)
    try:
        existing = set(admin.list_topics())
        _create(admin, [p for p in declared if p.name not in existing])
        there = [p for p in declared if p.name in existing]
        shapes = _shapes(admin, [p.name for p in there]) if there else {}
        for p in there:
            if p.name in shapes and shapes[p.name][0] != p.partitions:
                log.warning("topic %s has %d partitions, flywheel/topology.py declares %d: `flywheel topics` "
                            "reports every difference (docs/deploy.md, Topics)", p.name, shapes[p.name][0],
                            p.partitions)
    finally:
        admin.close()


def check_topics(kafka: KafkaSettings, topics: Topics) -> list[TopicCheck]:
    """``flywheel topics``: create the missing declared topics, then judge every existing one."""
    declared = _declared(topics, kafka, None)
    admin = _admin(kafka)
    try:
        existing = set(admin.list_topics())
        missing = [p for p in declared if p.name not in existing]
        _create(admin, missing)
        there = [p for p in declared if p.name in existing]
        shapes = _shapes(admin, [p.name for p in there]) if there else {}
        configs = _configs(admin, [p.name for p in there]) if there else {}
    finally:
        admin.close()
    out = []
    for p in declared:
        if p in missing:
            out.append(TopicCheck(p.name, Found.CREATED, p.partitions, p.replication_factor))
        else:
            parts, replicas = shapes.get(p.name, (0, 0))
            out.append(judge(p, parts, replicas, configs.get(p.name, {})))
    return out


def _configs(admin: KafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """Each topic's configs as the broker reports them; {} where it reports none (or may not:
    DESCRIBE_CONFIGS is the admin's alone)."""
    try:
        got = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names],
                                     config_filter="all")
    except Exception as e:  # noqa: BLE001 - unknown, not drift: the report says which configs it could not see
        log.warning("could not read the topics' configs (%s): they show as unknown", e)
        return {}
    return {name: {k: v.get("value") for k, v in cfgs.items()} for name, cfgs in got.get("topic", {}).items()}
