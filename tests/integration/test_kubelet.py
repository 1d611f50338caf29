"""tests/kubelet.py itself, on a pod whose container is ``sh``: what it mounts read-only refuses
writes, a claim is shared between pods, an emptyDir dies with its pod, paths and ports are the
pod's own, and a failing liveness probe restarts the container. The whole-deployment test
(test_k8s_whole.py) trusts these."""

from __future__ import annotations

import os
import time

import pytest
from kubelet import Cluster

pytestmark = pytest.mark.integration

#: Tries to write into each mount, notes which refused, then serves nothing (its liveness probe
#: then fails: the port is never opened).
SCRIPT = r"""
for d in "$CFG" "$SHARED_RO" "$IMAGE_DIR" "$SHARED_RW" "$SCRATCH"; do
  if (echo x > "$d/written") 2>/dev/null; then echo "$d writable"; else echo "$d refused"; fi
done > "$SCRATCH/report"
echo "$SERVE_PORT $SECRET_VALUE" >> "$SCRATCH/report"
sleep 600
"""


def deployment(name: str, *, claim_read_only: bool) -> dict:
    return {"kind": "Deployment", "metadata": {"name": name}, "spec": {"replicas": 1, "template": {"spec": {
        "enableServiceLinks": False, "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "c", "command": ["sh", "-c", SCRIPT],
            "ports": [{"name": "http", "containerPort": 8000}],
            "env": [{"name": "CFG", "value": "/etc/app"}, {"name": "SHARED_RO", "value": "/shared"},
                    {"name": "IMAGE_DIR", "value": "/home/flywheel"}, {"name": "SHARED_RW", "value": "/shared"},
                    {"name": "SCRATCH", "value": "/scratch"}, {"name": "SERVE_PORT", "value": "8000"},
                    {"name": "SECRET_VALUE", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "securityContext": {"readOnlyRootFilesystem": True},
            "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 1,
                              "failureThreshold": 2},
            "volumeMounts": [{"name": "cfg", "mountPath": "/etc/app", "readOnly": True},
                             {"name": "shared", "mountPath": "/shared", "readOnly": claim_read_only},
                             {"name": "scratch", "mountPath": "/scratch"}]}],
        "volumes": [{"name": "cfg", "configMap": {"name": "cm"}},
                    {"name": "shared", "persistentVolumeClaim": {"claimName": "claim"}},
                    {"name": "scratch", "emptyDir": {}}]}}}}


def test_a_pod_gets_its_mounts_ports_and_probes_as_a_kubelet_gives_them(tmp_path):
    resources = [deployment("reader", claim_read_only=True), deployment("writer", claim_read_only=False),
                 {"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a.toml": "x = 1"}},
                 {"kind": "PersistentVolumeClaim", "metadata": {"name": "claim"}}]
    with Cluster(resources, tmp_path, secrets={"s": {"k": "v"}}, services={}) as cluster:
        cluster.apply()
        reader, writer = cluster.pods_of("reader")[0], cluster.pods_of("writer")[0]
        reports = {p.name: p.dir / "volumes" / "scratch" / "report" for p in (reader, writer)}
        deadline = time.monotonic() + 30
        while not all(r.exists() and len(r.read_text().splitlines()) == 6 for r in reports.values()):
            assert time.monotonic() < deadline, "the containers wrote no report"
            time.sleep(0.1)
        said = {name: r.read_text().splitlines() for name, r in reports.items()}
        root = reader.root
        if os.geteuid() == 0:  # the kernel refuses, in the container's mount namespace (Pod.argv)
            assert said[reader.name][:5] == [f"{root}/etc/app refused", f"{root}/shared refused",
                                             f"{root}/home/flywheel refused", f"{root}/shared refused",
                                             f"{root}/scratch writable"]
            assert not reader.writes_outside_mounts()
        else:  # permissions refuse the ConfigMap; the check finds the write to the image's root
            assert said[reader.name][0] == f"{root}/etc/app refused"
            assert reader.writes_outside_mounts() == ["home/flywheel/written"]
        assert said[writer.name][1] == f"{writer.root}/shared writable"
        assert (tmp_path / "volumes" / "claim" / "written").exists()  # the claim both pods mount
        assert said[reader.name][5] == f"{reader.port('http')} v" and reader.port("http") != writer.port("http")
        # no port is ever opened: the liveness probe fails twice a second apart, and restarts it
        deadline = time.monotonic() + 30
        while reader.restarts == 0:
            assert time.monotonic() < deadline, cluster.events
            time.sleep(0.1)
        assert (reader.dir / "volumes" / "scratch").exists()  # a container restart keeps the emptyDir
        new = cluster.delete_pod(reader, grace_s=0)
        assert not (reader.dir / "volumes").exists() and new.name != reader.name
