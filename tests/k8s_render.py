"""Render deploy/k8s's kustomize overlays in Python, for the manifests' tests (no kubectl here).

Covers what deploy/k8s uses and nothing more: ``resources`` (files and directories),
``components``, ``configMapGenerator`` (the name's hash suffix, and the pods' references to it
rewritten), ``images``, ``labels`` (metadata only) and ``patches`` as JSON 6902 operations with a
target (kind, name, group, version, labelSelector). Anything else in a kustomization is refused,
so a manifest that needs more fails its test instead of passing half rendered.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "images", "labels", "patches"}


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(folder: Path) -> list[dict[str, Any]]:
    """Every resource the kustomization in ``folder`` makes."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN
    if unknown:
        raise ValueError(f"{folder}: kustomization fields this renderer does not know: {sorted(unknown)}")
    out: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = folder / res
        out += render(path) if path.is_dir() else load_docs(path)
    renamed: dict[str, str] = {}
    for gen in k.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in gen["files"]}
        digest = hashlib.sha256(repr(sorted(data.items())).encode()).hexdigest()[:10]
        renamed[gen["name"]] = f"{gen['name']}-{digest}"
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": renamed[gen["name"]]}, "data": data})
    for res in out:
        for vol in pod_spec(res).get("volumes", []) if pod_spec(res) else []:
            if "configMap" in vol and vol["configMap"]["name"] in renamed:
                vol["configMap"]["name"] = renamed[vol["configMap"]["name"]]
    for comp in k.get("components", []):
        out = apply_patches(out, yaml.safe_load((folder / comp / "kustomization.yaml").read_text()).get("patches", []))
    out = apply_patches(out, k.get("patches", []))
    for image in k.get("images", []):
        for c in containers(out):
            if c["image"].split(":")[0] == image["name"]:
                c["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
    for label in k.get("labels", []):
        for res in out:
            res.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    return out


def pod_spec(res: dict[str, Any]) -> dict[str, Any] | None:
    return res.get("spec", {}).get("template", {}).get("spec") if res.get("kind") in ("Deployment", "StatefulSet") else None


def containers(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for r in resources if pod_spec(r) for c in pod_spec(r)["containers"]]


def apply_patches(resources: list[dict[str, Any]], patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(resources)
    for p in patches:
        hits = [r for r in out if _matches(r, p["target"])]
        if not hits:
            raise ValueError(f"patch target {p['target']} matches no resource")
        for res in hits:
            for op in yaml.safe_load(p["patch"]):
                _apply(res, op)
    return out


def _matches(res: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = res["apiVersion"].rpartition("/")
    labels = res.get("metadata", {}).get("labels", {})
    wanted = dict(kv.split("=", 1) for kv in target.get("labelSelector", "").split(",") if kv)
    return (target.get("kind", res["kind"]) == res["kind"]
            and target.get("name", res["metadata"]["name"]) == res["metadata"]["name"]
            and target.get("group", group) == group and target.get("version", version) == version
            and all(labels.get(k) == v for k, v in wanted.items()))


def _apply(doc: dict[str, Any], op: dict[str, Any]) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent: Any = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if op["op"] == "add" and isinstance(parent, list):
        parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace" and (last not in parent if isinstance(parent, dict) else int(last) >= len(parent)):
            raise KeyError(f"replace of a path that is not there: {op['path']}")
        parent[int(last) if isinstance(parent, list) else last] = op["value"]
    elif op["op"] == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise ValueError(f"JSON patch operation this renderer does not know: {op['op']}")


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize`` makes of ``folder``, as a cluster would get it; this module's
    :func:`render` only where kubectl is not installed."""
    import shutil
    import subprocess

    if shutil.which("kubectl") is None:
        return render(folder)
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ``ENV`` of a Dockerfile's last stage (the image a pod runs), as the runtime sees it
    before the pod's own env: the variables a manifest does not set come from here."""
    import shlex

    text = dockerfile.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split(None, 1)
        if words and words[0].upper() == "FROM":
            env = {}  # a new stage starts with nothing of the previous one's
        elif len(words) == 2 and words[0].upper() == "ENV":
            for pair in shlex.split(words[1]):
                name, _, value = pair.partition("=")
                env[name] = value.replace("$PATH", env.get("PATH", "$PATH"))
    return env
