"""The shipped manifests run as a whole: the cpu overlay rendered by ``kubectl kustomize`` and every
pod started as a kubelet would (tests/kubelet.py), against the session's broker and a throwaway
PostgreSQL database, with the test overlay tests/k8s/whole (auto-promote, short cadences), and
again with tests/k8s/whole-s3, the same overlay with the shipped object-store component: the
checkpoints on a local S3 API (moto's server mode on loopback) and no checkpoint claim.

Users reach serving's pods as a product would (round-robin, as the Service spreads them) and give
feedback; the trainer learns, the release controller gates, canaries and promotes, and serving's
pods follow. The long form (slow suite) then deletes a serving pod, the release leader, and rolls
ingest and reward, and counts every episode and reward exactly once, on either store.

    .venv/bin/python -m pytest tests/integration/test_k8s_whole.py -x -q            # short form
    .venv/bin/python -m pytest tests/integration/test_k8s_whole.py -x -q -m slow    # long form
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from conftest import RELEASE_TEST_POSTGRES_URL, postgres_admin, read_all
from kubelet import Cluster, Pod, render

from flywheel.contracts import EpisodeEvent, RewardEvent, Topics, decode

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parents[1]
KEY, TOKEN = "sk-whole-test", "t0ken-whole"


@contextmanager
def database() -> Iterator[str]:
    """A throwaway PostgreSQL database: the release store's and the stream stages' (one URL, as
    a small deployment gives both Secrets keys the same database)."""
    admin = postgres_admin(RELEASE_TEST_POSTGRES_URL)
    name = f"k8s_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield RELEASE_TEST_POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        admin.execute(f'DROP DATABASE "{name}"')
        admin.close()


#: The object store's Service address in components/object-store, mapped to the local S3 API.
S3_SERVICE = "minio.storage.svc:9000"


def secrets(db_url: str, keys: Path) -> dict[str, dict[str, str]]:
    """The Secrets docs/deploy.md has the operator create, with keys made as its guide makes them
    (the object store's credentials file too: only pods that mount it read it)."""
    from flywheel.signing import generate_key_pair

    for key_id in ("release-2026-11", "trainer-2026-11"):
        generate_key_pair(keys, key_id)
    return {
        "flywheel-object-store": {"credentials": "[default]\naws_access_key_id = flywheel-test\n"
                                                 "aws_secret_access_key = flywheel-test\n"},
        "flywheel-secrets": {"api-keys": KEY, "user-id-salt": uuid.uuid4().hex, "routing-secret": uuid.uuid4().hex,
                             "release-tokens": f"ops:admin:{TOKEN}",
                             "database-url": db_url, "stream-database-url": db_url},
        "flywheel-release-key": {"release-2026-11.key": (keys / "release-2026-11.key").read_text()},
        "flywheel-release-public-keys": {"release-2026-11.pub": (keys / "release-2026-11.pub").read_text()},
        "flywheel-trainer-key": {"trainer-2026-11.key": (keys / "trainer-2026-11.key").read_text()},
        "flywheel-trainer-public-keys": {"trainer-2026-11.pub": (keys / "trainer-2026-11.pub").read_text()},
    }


def overlay(tmp_path: Path, prefix: str, variant: str = "whole", store: str | None = None) -> Path:
    """tests/k8s/<variant> with this run's topics and consumer groups: the session's broker is
    shared, and the embedded broker wants groups of their own per test (local/broker.py); and with
    ``store``, this run's bucket in the object-store component's ConfigMap, as an operator's
    overlay sets theirs."""
    folder = tmp_path / "overlay"
    folder.mkdir()
    env = {"FLYWHEEL_TOPIC_PREFIX": prefix, "FLYWHEEL_INGEST_GROUP_ID": f"{prefix}ingest",
           "FLYWHEEL_REWARD_GROUP_ID": f"{prefix}reward", "FLYWHEEL_RELEASE_GROUP_ID": f"{prefix}release"}
    ops = "".join(f"      - {{op: add, path: /spec/template/spec/containers/0/env/-, value: {{name: {k}, value: {v}}}}}\n"
                  for k, v in env.items())
    (folder / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(HERE / 'k8s' / variant, folder)}\n"
        "patches:\n  - target: {kind: Deployment}\n    patch: |-\n" + ops
        + ("" if store is None else "  - target: {kind: ConfigMap, name: flywheel-object-store}\n    patch: |-\n"
           f"      - {{op: replace, path: /data/FLYWHEEL_TRAINER_STORE, value: \"{store}\"}}\n"))
    return folder


@pytest.fixture
def cluster(request, broker, tiny_model_dir, tmp_path) -> Iterator[Cluster]:
    """The rendered test overlay as a :class:`Cluster` (no pod started yet), with its Secrets, the
    model where docs/deploy.md has the operator put it, and the Services' names mapped to the
    session's broker and, for ``whole-s3`` (the indirect parameter), to the session's S3 API,
    where the checkpoints go to a new bucket. ``cluster.store``: the object store's URL, or None."""
    variant = getattr(request, "param", "whole")
    prefix = f"t{uuid.uuid4().hex[:10]}."
    services = {"kafka-bootstrap.kafka.svc:9092": broker.bootstrap}
    store = None
    if variant == "whole-s3":
        import fsspec

        endpoint = request.getfixturevalue("s3_endpoint")  # this process's S3 clients point there too
        services[S3_SERVICE] = endpoint.removeprefix("http://")
        bucket = f"flywheel-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3").mkdir(bucket)  # the operator makes the bucket (docs/deploy.md)
        store = f"s3://{bucket}/checkpoints"
    with database() as db:
        c = Cluster(render(overlay(tmp_path, prefix, variant, store)), tmp_path / "cluster",
                    secrets=secrets(db, tmp_path / "keys"), services=services)
        c.topics, c.store = Topics(prefix), store
        # the model where docs/deploy.md has the operator copy it: model/ on the checkpoint claim,
        # or the model claim of its own beside an object store
        model = ("flywheel-checkpoints/model" if store is None else "flywheel-model")
        shutil.copytree(tiny_model_dir, c.root / "volumes" / model)
        with c:
            yield c
        for pod in c.pods:
            assert not pod.writes_outside_mounts(), f"{pod.name} wrote where its pod may not"


class Users:
    """Users of the product on a thread: each asks a serving pod (round-robin, as the Service
    spreads requests) and judges the answer: a version above 0 accepted, version 0 accepted a
    third of the time. The canary then wins its comparison, and the trainer gets both signals."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.rng = random.Random(7)
        self.versions: list[int] = []
        self.judged: list[str] = []  # generation ids whose feedback serving took (202)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        n = 0
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not self._stop.is_set():
                pods = [p for p in self.cluster.pods_of("flywheel-serving") if p.ready]
                if not pods:
                    time.sleep(0.2)
                    continue
                n += 1
                # 120 users: the controller counts one outcome per user per canary, and 40 ran out
                # at 14 pairs (9 won by the canary, none lost), short of the first canary's level
                self._one(http, pods[n % len(pods)], f"user-{n % 120}")

    def _one(self, http: httpx.Client, pod: Pod, user: str) -> None:
        try:
            r = http.post(pod.url() + "/v1/completions", json={
                "model": "flywheel", "prompt": self.rng.choice(["once upon a time", "the sea", "a b c"]),
                "max_tokens": 4, "temperature": 1.0, "user": user})
            if r.status_code != 200:
                self.errors.append(f"{r.status_code} {r.text[:200]}")
                return
            body = r.json()
            version = int(body["model"].rsplit("@v", 1)[1])
            self.versions.append(version)
            signal = "accept" if version > 0 or self.rng.random() < 0.33 else "reject"
            f = http.post(pod.url() + "/v1/feedback", json={
                "feedback_id": str(uuid.uuid4()), "generation_id": body["id"], "signal": signal,
                "decision_ms": 500.0, "user": user})
            if f.status_code == 202:
                self.judged.append(body["id"])
        except httpx.HTTPError as exc:  # a pod going away under a request: the product sees an error
            self.errors.append(repr(exc))


def release_status(pod: Pod) -> dict[str, Any]:
    r = httpx.get(pod.url() + "/api/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def until(cond, what: str, timeout_s: float, cluster: Cluster) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := cond():
                return value
        except (httpx.HTTPError, KeyError, StopIteration):
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; events {cluster.events}; " + "; ".join(
        f"{p.name}: {p.log()[-1200:]}" for p in cluster.pods_of_all()))


def serving_stable(pod: Pod) -> int:
    """The version serving ``pod`` answers its stable users with (its /health, with a key)."""
    r = httpx.get(pod.url() + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    return r.json()["versions"]["stable"]


def promoted(cluster: Cluster, version: int) -> bool:
    """Every release pod's view of the store has ``version`` (or later) stable, and every
    serving pod answers with it."""
    statuses = [release_status(p) for p in cluster.pods_of("flywheel-release")]
    return (all(s["stable_version"] >= version for s in statuses)
            and all(serving_stable(p) >= version for p in cluster.pods_of("flywheel-serving")))


def leader(cluster: Cluster) -> Pod | None:
    """The release pod whose controller holds the lease (its own /api/status says so), once one
    alone says so. A controller reads its lease as a turn starts (release/controller.py): one whose
    lease lapsed during a long turn (a gate of a minute on a loaded machine, past a TTL of 5 s)
    says it is active until that turn ends, while the other has taken the lease over."""
    active = [p for p in cluster.pods_of("flywheel-release") if p.ready and release_status(p)["controller"]["active"]]
    return active[0] if len(active) == 1 else None


def restarts(cluster: Cluster) -> list[str]:
    """Container restarts. None is expected: the two release replicas of a fresh install used to
    race making the store's schema on the empty database, and one was restarted every time
    (release/store.py now takes turns on an advisory lock)."""
    return [e for e in cluster.events if "restarted" in e]


def test_the_shipped_manifests_start_every_stage_and_get_ready(cluster):
    """Every pod of the cpu overlay but serving's (whose engines take minutes to start here: the
    slow test below runs them) starts from its rendered spec and gets ready through its own probes;
    one release controller holds the lease and has registered the trainer's version 0, read from
    the checkpoint claim through its own mount."""
    cluster.apply(skip=("flywheel-serving",))
    cluster.wait_ready(timeout_s=240)
    assert sorted(p.deployment for p in cluster.pods_of_all()) == [
        "flywheel-ingest", "flywheel-ingest", "flywheel-release", "flywheel-release", "flywheel-reward",
        "flywheel-reward", "flywheel-trainer"]
    lead = until(lambda: leader(cluster), "a release pod holding the lease", 60, cluster)
    until(lambda: release_status(lead)["candidates"], "version 0 registered", 60, cluster)
    assert not restarts(cluster), cluster.events


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 8.5 to 10 minutes measured on 2 shared cores
@pytest.mark.parametrize("cluster", ["whole", "whole-s3"], indirect=True)
def test_the_shipped_manifests_promote_and_survive_pod_deletions_and_a_rolling_restart(cluster):
    """Through every pod of the cpu overlay: users' feedback trains a version, which the
    controller gates, canaries and promotes, and serving follows; a serving pod killed comes back,
    its emptyDir wiped, to the current routing; the release leader deleted, the standby takes the
    lease; ingest and reward rolled one pod at a time under traffic, and every judged generation
    becomes one episode and one reward, none twice. With the checkpoints on the object store
    (whole-s3) no pod mounts a checkpoint claim (none is rendered): the trainer publishes to the
    bucket, and the controller and serving's pods, the new one included, fetch from it."""
    cluster.apply()
    cluster.wait_ready(timeout_s=600)
    with Users(cluster) as users:
        until(lambda: promoted(cluster, 1), "version 1 promoted and served", 600, cluster)
        lead = until(lambda: leader(cluster), "one release pod holding the lease", 180, cluster)
        candidate = httpx.get(lead.url() + "/api/candidates/1", headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=10).json()
        assert {"gating", "canary", "promoted"} <= {a["to_state"] for a in candidate["audit"]}, candidate["audit"]
        assert candidate["gate"]["outcome"] == "pass"
        if cluster.store is not None:  # announced, gated and served from the bucket
            from flywheel.checkpoints import ObjectStore

            assert candidate["uri"] == f"{cluster.store}/v00000001", candidate["uri"]
            assert 1 in ObjectStore(cluster.store).versions()

        # a serving pod killed: the new pod starts with an empty emptyDir and follows the routing
        killed = cluster.pods_of("flywheel-serving")[0]
        fresh = cluster.delete_pod(killed, grace_s=0)
        assert not (killed.dir / "volumes").exists()
        cluster.wait_ready([fresh], timeout_s=600)
        stable = release_status(lead)["stable_version"]
        until(lambda: serving_stable(fresh) == release_status(lead)["stable_version"] >= stable,
              "the new serving pod on the current routing", 120, cluster)

        # the release leader deleted: the standby takes the lease within its TTL (and a gate)
        standby = next(p for p in cluster.pods_of("flywheel-release") if p is not lead)
        cluster.delete_pod(lead)
        until(lambda: release_status(standby)["controller"]["active"], "the standby holding the lease", 120, cluster)

        # ingest and reward rolled under traffic, as `kubectl rollout restart` does
        for deployment in ("flywheel-ingest", "flywheel-reward"):
            cluster.rollout_restart(deployment, timeout_s=300)
        time.sleep(10)
    judged = set(users.judged)
    assert len(judged) > 50 and not restarts(cluster), cluster.events
    bootstrap = cluster.services["kafka-bootstrap.kafka.svc:9092"]
    episodes = until(lambda: _all_of(bootstrap, cluster.topics.episodes, EpisodeEvent, judged), "every episode",
                     180, cluster)
    rewards = until(lambda: _all_of(bootstrap, cluster.topics.rewards, RewardEvent, judged), "every reward",
                    180, cluster)
    for name, ids in (("episodes", episodes), ("rewards", rewards)):
        twice = {g for g in ids if ids.count(g) > 1}
        assert not twice, f"{len(twice)} generations with more than one of their {name}"


def _all_of(bootstrap: str, topic: str, kind: type, judged: set[str]) -> list[str] | None:
    """The generation ids of every record on ``topic``, once every judged generation has one."""
    records = [decode(kind, r.value) for r in read_all(bootstrap, topic, expect=0, timeout_s=30)]
    ids = [r.generation.generation_id if kind is EpisodeEvent else r.generation_id for r in records]
    return ids if judged <= set(ids) else None
