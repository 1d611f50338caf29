"""Every Kafka topic Flywheel uses, declared once: its key, partitions, cleanup, retention,
replication, who writes it, who reads it and who signs it.

Everything else is made from this table, never written beside it:

- the topics themselves: ``flywheel topics`` and every role's start-up creation
  (flywheel/kafka/topics.py), so no role ever makes a topic with another partition count or
  replication factor than the others would;
- the drift report of ``flywheel topics`` on a cluster whose topics were made otherwise;
- the topic table of docs/deploy.md and the ACL table of docs/signing.md
  (``flywheel topics table``, ``flywheel topics acls``);
- the Strimzi component deploy/k8s/components/strimzi-topics (``flywheel topics manifests``):
  a ``KafkaTopic`` per topic and a ``KafkaUser`` per role holding exactly that role's ACLs.

tests/unit/test_topology.py holds the docs and the component equal to what this module makes.
Pure: no broker, no Kafka client (the admin side is flywheel/kafka/topics.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from flywheel.contracts import Topics
from flywheel.settings import KafkaSettings, Settings


class Cleanup(StrEnum):
    """Kafka's ``cleanup.policy``."""

    DELETE = "delete"  # records older than the retention go
    COMPACT = "compact"  # only each key's latest record is kept, for ever


class PartitionRule(StrEnum):
    """How many partitions a topic gets."""

    #: ``kafka.partitions``: the unit of the stream stages' parallelism. Generations, feedback,
    #: episodes and rewards must all have this same count: a generation, its feedback, its episode
    #: and its reward are keyed alike and must land on the same partition number (docs/architecture.md).
    STAGE = "kafka.partitions"
    #: One: the records are few and their order across keys matters to the one reader.
    ONE = "1"


class Role(StrEnum):
    """A process that holds its own Kafka principal (``flywheel-<role>``, docs/signing.md)."""

    SERVING = "serving"
    INGEST = "ingest"
    REWARD = "reward"
    TRAINER = "trainer"
    RELEASE = "release"
    DEADLETTERS = "deadletters"
    REPLAY = "replay"
    ADMIN = "admin"

    @property
    def principal(self) -> str:
        return f"flywheel-{self.value}"


@dataclass(frozen=True)
class RoleSpec:
    """A role as the ACLs see it."""

    role: Role
    #: Who runs as it, for people (docs/signing.md's table).
    runs: str
    #: The settings section whose ``group_id`` its consumer group is, or None (no group).
    group_section: str | None
    #: The group cell of the ACL table when there is no group, or what else it needs.
    note: str = ""


@dataclass(frozen=True)
class TopicSpec:
    """One topic, under the deployment's prefix (``topic_prefix``)."""

    #: The name after the prefix: ``flywheel.`` + ``generations``.
    suffix: str
    #: The record type it carries (flywheel/contracts.py).
    record: str
    #: What its records are keyed by.
    key: str
    partitions: PartitionRule
    cleanup: Cleanup
    #: How long a record is kept under ``Cleanup.DELETE``; a compacted topic keeps each key's
    #: latest record for ever and has none.
    retention: timedelta | None
    producers: tuple[Role, ...]
    consumers: tuple[Role, ...]
    #: Who signs its records (flywheel/signing.py), or None: unsigned, ACLs alone vouch for them.
    signer: Role | None
    #: Why it is kept this way, for the docs' table.
    why: str

    def name(self, prefix: str) -> str:
        return f"{prefix}{self.suffix}"


_DAY = timedelta(days=1)

#: The registry. Every topic of :class:`~flywheel.contracts.Topics`, in its order.
TOPICS: tuple[TopicSpec, ...] = (
    # Ingest replays generations after a restore, and joins feedback to them within its window:
    # never compacted (several feedback events share a generation's key, compaction would keep the
    # last). 7 days outlasts ingest.window_s + ingest.orphan_wait_s and any outage worth surviving.
    TopicSpec("generations", "GenerationEvent", "generation_id", PartitionRule.STAGE, Cleanup.DELETE, 7 * _DAY,
              (Role.SERVING, Role.REPLAY), (Role.INGEST, Role.REPLAY), None,
              "ingest replays it after a restore; its partitions are ingest's unit of parallelism"),
    TopicSpec("feedback", "FeedbackEvent", "generation_id", PartitionRule.STAGE, Cleanup.DELETE, 7 * _DAY,
              (Role.SERVING, Role.REPLAY), (Role.INGEST, Role.REPLAY), None,
              "several events share a generation's key: compaction would keep only the last"),
    TopicSpec("episodes", "EpisodeEvent", "generation_id", PartitionRule.STAGE, Cleanup.DELETE, 7 * _DAY,
              (Role.INGEST, Role.REPLAY), (Role.REWARD, Role.RELEASE, Role.REPLAY), None,
              "reward's unit of parallelism; the controller measures canaries from it"),
    # The trainer resumes from the offsets inside its newest version: what retention deletes
    # before a trainer outage ends is lost to training, so as long as the stage inputs.
    TopicSpec("rewards", "RewardEvent", "generation_id", PartitionRule.STAGE, Cleanup.DELETE, 7 * _DAY,
              (Role.REWARD, Role.REPLAY), (Role.TRAINER, Role.RELEASE, Role.REPLAY), None,
              "longer than the time between two versions plus any trainer outage"),
    # One partition: versions are announced in order and the controller gates them in that order.
    # Compacted: each version is its own key, so compaction drops only a version announced twice
    # (a trainer restart) and a controller down for any time still finds every announcement.
    TopicSpec("checkpoints", "CheckpointEvent", "version", PartitionRule.ONE, Cleanup.COMPACT, None,
              (Role.TRAINER,), (Role.RELEASE,), Role.TRAINER,
              "one record per version, in order; nothing lost to a controller outage"),
    # Serving needs only each deployment's latest routing: compacted, so a serving pod started at
    # any time finds it however old it is (retention once deleted it, and the pod served model_dir).
    TopicSpec("releases", "ReleaseEvent", "deployment", PartitionRule.ONE, Cleanup.COMPACT, None,
              (Role.RELEASE,), (Role.SERVING,), Role.RELEASE,
              "serving needs each deployment's latest routing, however old"),
    # Never compacted: every serving instance's reports share the deployment's key, and a refusal
    # compacted away under a later report is a refused canary left to its deadline. Kept longer
    # than any controller outage (it reads on from the offsets its database keeps).
    TopicSpec("serving-status", "ServingStatusEvent", "deployment", PartitionRule.ONE, Cleanup.DELETE, 7 * _DAY,
              (Role.SERVING,), (Role.RELEASE,), None,
              "every serving instance's reports share the key: never compacted"),
    # Letters are few and kept until someone has looked (an alert pages on them, the on-call
    # replays from here): 30 days, and never compacted (letters of one source key are distinct).
    TopicSpec("deadletter", "DeadLetterEvent", "source key", PartitionRule.STAGE, Cleanup.DELETE, 30 * _DAY,
              (Role.SERVING, Role.INGEST, Role.REWARD, Role.TRAINER, Role.RELEASE),
              (Role.DEADLETTERS, Role.REPLAY), None,
              "kept until someone has looked: `flywheel deadletters replay` sends letters back from here"),
)

ROLES: tuple[RoleSpec, ...] = (
    RoleSpec(Role.SERVING, "`flywheel serve`", None, "none: it reads `releases` by assignment"),
    RoleSpec(Role.INGEST, "`flywheel ingest`", "ingest"),
    RoleSpec(Role.REWARD, "`flywheel reward`", "reward"),
    RoleSpec(Role.TRAINER, "`flywheel train`, rank 0", "trainer"),
    RoleSpec(Role.RELEASE, "`flywheel release serve`", "release"),
    RoleSpec(Role.DEADLETTERS, "`flywheel deadletters summary`/`show`", None, "none"),
    RoleSpec(Role.REPLAY, "`flywheel deadletters replay`, on-call", None, "none"),
    RoleSpec(Role.ADMIN, "`flywheel topics`", None, "CREATE and DESCRIBE_CONFIGS on the topic prefix"),
)


def spec(suffix: str) -> TopicSpec:
    return next(t for t in TOPICS if t.suffix == suffix)


def role_topics(role: Role) -> tuple[TopicSpec, ...]:
    """The topics ``role`` reads or writes: what it creates at start if they are missing."""
    return tuple(t for t in TOPICS if role in t.producers or role in t.consumers)


def min_insync_replicas(replication_factor: int) -> int:
    """With acks=all, how many replicas must have a record before it counts as written: 2 once
    there are 3 (one broker may be down and every acked record is still on two), else 1 (with 2
    replicas, 2 would stop every write while one broker restarts)."""
    return 2 if replication_factor >= 3 else 1


@dataclass(frozen=True)
class TopicPlan:
    """A declared topic under one deployment's settings: what ``flywheel topics`` makes."""

    spec: TopicSpec
    name: str
    partitions: int
    replication_factor: int
    #: Topic configs, as Kafka's admin API takes them (strings).
    configs: dict[str, str]


def plan(spec_: TopicSpec, prefix: str, kafka: KafkaSettings) -> TopicPlan:
    configs = {
        "cleanup.policy": spec_.cleanup.value,
        # a record as large as a produce request: Kafka's default (about 1 MB) is below the
        # largest valid episode, and a refused record is refused at every try (docs/exactly-once.md)
        "max.message.bytes": str(kafka.max_request_bytes),
        "min.insync.replicas": str(min_insync_replicas(kafka.replication_factor)),
    }
    if spec_.retention is not None:
        configs["retention.ms"] = str(int(spec_.retention.total_seconds() * 1000))
    partitions = kafka.partitions if spec_.partitions is PartitionRule.STAGE else 1
    return TopicPlan(spec_, spec_.name(prefix), partitions, kafka.replication_factor, configs)


def plans(prefix: str, kafka: KafkaSettings, specs: tuple[TopicSpec, ...] = TOPICS) -> tuple[TopicPlan, ...]:
    return tuple(plan(s, prefix, kafka) for s in specs)


def check_registry() -> None:
    """The registry covers exactly :class:`Topics`, once each, in its order; ValueError if not."""
    names = tuple(t.name("") for t in TOPICS)
    if names != Topics("").all():
        raise ValueError(f"flywheel/topology.py declares {names}, flywheel/contracts.py Topics has {Topics('').all()}")


# -- generated docs --------------------------------------------------------------------------------

def _retention(t: TopicSpec) -> str:
    if t.retention is None:
        return "for ever (latest record per key)"
    return f"{t.retention.days} days"


def _roles(roles: tuple[Role, ...]) -> str:
    return ", ".join(r.value for r in roles) or "none"


def topic_table(settings: Settings | None = None) -> str:
    """docs/deploy.md's topic table (``flywheel topics table``)."""
    prefix = (settings or Settings()).topic_prefix
    rows = ["| topic | key | partitions | cleanup | retention | written by | read by | signed by | why |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in TOPICS:
        parts = "`kafka.partitions`" if t.partitions is PartitionRule.STAGE else "1"
        rows.append(f"| `{t.name(prefix)}` | {t.key} | {parts} | {t.cleanup.value} | {_retention(t)} "
                    f"| {_roles(t.producers)} | {_roles(t.consumers)} | {t.signer.value if t.signer else 'none'} "
                    f"| {t.why} |")
    return "\n".join(rows) + "\n"


def reads(role: Role) -> tuple[TopicSpec, ...]:
    return tuple(t for t in TOPICS if role in t.consumers)


def writes(role: Role) -> tuple[TopicSpec, ...]:
    return tuple(t for t in TOPICS if role in t.producers)


def group_id(r: RoleSpec, settings: Settings) -> str | None:
    return getattr(settings, r.group_section).group_id if r.group_section else None


def acl_table(settings: Settings | None = None) -> str:
    """docs/signing.md's table of ACLs per role (``flywheel topics acls``)."""
    settings = settings or Settings()
    rows = ["| principal | READ (consume) | WRITE (produce) | consumer group (READ) |",
            "| --- | --- | --- | --- |"]
    for r in ROLES:
        read = ", ".join(f"`{t.suffix}`" for t in reads(r.role))
        write = ", ".join(f"`{t.suffix}`" for t in writes(r.role)) or ("" if r.role is Role.ADMIN else "none")
        group = f"`{r.group_section}.group_id` (`{group_id(r, settings)}`)" if r.group_section else r.note
        rows.append(f"| {r.role.principal} ({r.runs}) | {read} | {write} | {group} |")
    return "\n".join(rows) + "\n"


# -- Strimzi ---------------------------------------------------------------------------------------

STRIMZI = "kafka.strimzi.io/v1beta2"


def _k8s_name(topic: str) -> str:
    """A topic's KafkaTopic name: Kubernetes names allow no '_' and Strimzi's convention is no '.'."""
    return topic.replace(".", "-").replace("_", "-").lower().strip("-")


def _acl(kind: str, name: str, operations: list[str], pattern: str = "literal") -> dict[str, Any]:
    return {"resource": {"type": kind, "name": name, "patternType": pattern}, "operations": operations}


def role_acls(r: RoleSpec, settings: Settings) -> list[dict[str, Any]]:
    """A role's ACLs: READ what it consumes, WRITE what it produces, its group, and DESCRIBE on
    every topic of the prefix (each process lists the topics at start, and a topic it may not
    describe looks missing: docs/signing.md)."""
    prefix = settings.topic_prefix
    acls = [_acl("topic", prefix, ["Describe"], "prefix")]
    if r.role is Role.ADMIN:
        acls.append(_acl("topic", prefix, ["Create", "DescribeConfigs"], "prefix"))
    acls += [_acl("topic", t.name(prefix), ["Read"]) for t in reads(r.role)]
    acls += [_acl("topic", t.name(prefix), ["Write"]) for t in writes(r.role)]
    if (group := group_id(r, settings)) is not None:
        acls.append(_acl("group", group, ["Read"]))
    return acls


def strimzi_resources(settings: Settings, cluster: str) -> list[dict[str, Any]]:
    """A ``KafkaTopic`` per declared topic and a ``KafkaUser`` per role (SCRAM-SHA-512, its ACLs),
    for a Strimzi cluster named ``cluster``."""
    labels = {"strimzi.io/cluster": cluster, "app.kubernetes.io/part-of": "flywheel"}
    out: list[dict[str, Any]] = []
    for p in plans(settings.topic_prefix, settings.kafka):
        config: dict[str, Any] = {k: int(v) if v.isdigit() else v for k, v in p.configs.items()}
        out.append({"apiVersion": STRIMZI, "kind": "KafkaTopic",
                    "metadata": {"name": _k8s_name(p.name), "labels": dict(labels)},
                    "spec": {"topicName": p.name, "partitions": p.partitions, "replicas": p.replication_factor,
                             "config": config}})
    for r in ROLES:
        out.append({"apiVersion": STRIMZI, "kind": "KafkaUser",
                    "metadata": {"name": r.role.principal, "labels": dict(labels)},
                    "spec": {"authentication": {"type": "scram-sha-512"},
                             "authorization": {"type": "simple", "acls": role_acls(r, settings)}}})
    return out


#: The roles that run as a Deployment of the manifests, named after their principal.
DEPLOYED = (Role.SERVING, Role.INGEST, Role.REWARD, Role.TRAINER, Role.RELEASE)
#: The ConfigMap holding each deployed role's principal, its SASL username.
PRINCIPALS_CONFIGMAP = "flywheel-kafka-principals"


def principals_configmap() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": PRINCIPALS_CONFIGMAP},
            "data": {r.value: r.principal for r in DEPLOYED}}


def credential_patches() -> list[dict[str, Any]]:
    """Each deployed role logs in as its own principal: the ``kafka`` volume of the kafka-sasl-ssl
    component becomes the role's username (the principals ConfigMap), the password Strimzi's user
    operator keeps in a Secret named after the KafkaUser, and the cluster's CA from flywheel-kafka."""
    out = []
    for r in DEPLOYED:
        sources = [{"configMap": {"name": PRINCIPALS_CONFIGMAP, "items": [{"key": r.value, "path": "username"}]}},
                   {"secret": {"name": r.principal, "items": [{"key": "password", "path": "password"}]}},
                   {"secret": {"name": "flywheel-kafka", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]
        out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": r.principal},
                    "spec": {"template": {"spec": {"volumes": [
                        {"name": "kafka", "secret": None, "projected": {"sources": sources}}]}}}})
    return out


def _yaml_docs(head: str, docs: list[dict[str, Any]]) -> str:
    import yaml

    return head + "---\n" + "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=120)
                                         for d in docs)


def strimzi_files(settings: Settings, cluster: str = "kafka") -> dict[str, str]:
    """deploy/k8s/components/strimzi-topics' generated files (``flywheel topics manifests``)."""
    head = ("# Generated by `flywheel topics manifests` from flywheel/topology.py: do not edit, regenerate.\n"
            f"# Partitions and replicas from the manifests' kafka.partitions ({settings.kafka.partitions}) and\n"
            f"# kafka.replication_factor ({settings.kafka.replication_factor}); Strimzi cluster `{cluster}`.\n")
    return {"topics.yaml": _yaml_docs(head, [*strimzi_resources(settings, cluster), principals_configmap()]),
            "credentials.yaml": _yaml_docs(head.splitlines(keepends=True)[0], credential_patches())}


def declared_partitions(name: str, topics: Topics, kafka: KafkaSettings) -> int:
    """How many partitions the declared topic ``name`` (one of ``topics``) has: a reader that
    reads a topic whole asks here rather than assuming ``kafka.partitions``."""
    (match,) = (t for t in TOPICS if t.name(topics.prefix) == name)
    return plan(match, topics.prefix, kafka).partitions
