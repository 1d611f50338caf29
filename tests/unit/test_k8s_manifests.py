"""deploy/k8s against the Kubernetes schemas and against the code, offline.

Every overlay is rendered (tests/k8s_render.py) and each resource validated strictly against the
Kubernetes 1.37 OpenAPI schemas that ``kubernetes-validate`` carries. Then the manifests are held
to the code: every ``FLYWHEEL_*`` variable names a setting, each role's settings load from the
ConfigMap and its env, each containerPort is the port its role listens on, each probe's path is a
route the role answers, and each grace period covers what the role does on SIGTERM.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_render import apply_patches, kustomize, load_docs, pod_spec, render

from flywheel.environment import FILE_SUFFIX
from flywheel.metrics import OPS_PATHS
from flywheel.settings import Settings, load_settings, setting_of

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
#: The role's command (the container's args, or the shell's exec), and its port's setting.
ROLES = {"serve": "serve", "ingest": "ingest", "reward": "reward", "train": "trainer", "release": "release"}


def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / overlay)


def with_kafka_component(overlay: str) -> list[dict[str, Any]]:
    comp = yaml.safe_load((K8S / "components" / "kafka-sasl-ssl" / "kustomization.yaml").read_text())
    return apply_patches(rendered(overlay), comp["patches"])


def workloads(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in resources if pod_spec(r)]


def role(workload: dict[str, Any]) -> str:
    c = pod_spec(workload)["containers"][0]
    words = " ".join(c.get("args", [])).split()
    cmd = words[-1] if c.get("command") else words[0]  # sh -c '... exec flywheel <role>' or [<role>, ...]
    return ROLES[cmd]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_resource_is_valid_kubernetes(overlay):
    for resources in (rendered(overlay), with_kafka_component(overlay)):
        kinds = sorted({r["kind"] for r in resources})
        assert kinds == ["ConfigMap", "Deployment", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]
        for res in resources:
            kubernetes_validate.validate(res, "1.37.0", strict=True)


def test_every_manifest_file_is_valid_kubernetes():
    files = sorted(K8S.glob("base/*.yaml")) + [K8S / "secrets.example.yaml"]
    files = [f for f in files if f.name != "kustomization.yaml"]
    assert len(files) == 8
    for f in files:
        for doc in load_docs(f):
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_a_wrong_manifest_is_refused():
    """The validator does refuse what Kubernetes would: a misspelt field, a wrong type."""
    serving = next(r for r in rendered("cpu") if r["metadata"]["name"] == "flywheel-serving" and pod_spec(r))
    pod_spec(serving)["enableServiceLink"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(serving, "1.37.0", strict=True)
    pvc = load_docs(K8S / "base" / "checkpoints.yaml")[0]
    pvc["spec"]["accessModes"] = "ReadWriteMany"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, "1.37.0", strict=True)


def manifest_variables(workload: dict[str, Any]) -> dict[str, str]:
    """Every FLYWHEEL_* variable a workload's container sets, in its env or in its shell line."""
    c = pod_spec(workload)["containers"][0]
    env = {e["name"]: e["value"] for e in c.get("env", []) if e["name"].startswith("FLYWHEEL_")}
    for name in re.findall(r"\b(FLYWHEEL_[A-Z0-9_]+)=", " ".join(c.get("args", []))):
        env[name] = "0"
    return env


def test_every_variable_names_a_setting():
    seen = set()
    for overlay in OVERLAYS:
        for w in workloads(with_kafka_component(overlay)):
            for name in manifest_variables(w):
                if name == "FLYWHEEL_CONFIG":  # the config file's path, not a setting
                    continue
                stem = name.removesuffix(FILE_SUFFIX)
                assert setting_of(name) or (stem != name and setting_of(stem)), \
                    f"{w['metadata']['name']}: {name} names no setting (flywheel/settings.py)"
                seen.add(name)
    assert {"FLYWHEEL_API_KEYS_FILE", "FLYWHEEL_KAFKA_SASL_PASSWORD_FILE", "FLYWHEEL_STREAM_DATABASE_URL_FILE"} <= seen
    assert setting_of("FLYWHEEL_SERVE_DRAIN") is None  # the check can fail


#: What the mounted secrets hold here, to load each role's settings.
_FILES = {"api-keys": "sk-a,sk-b", "user-id-salt": "salt", "release-tokens": "ops:admin:t0ken",
          "database-url": "postgresql://u:p@db:5432/flywheel", "username": "flywheel", "password": "pw",
          "stream-database-url": "postgresql://u:p@db:5432/flywheel"}


def role_settings(workload: dict[str, Any], tmp_path: Path) -> Settings:
    """The role's settings as its pod would load them: the ConfigMap's file, then its env, with
    every file it names under /etc/flywheel made here."""
    env = {}
    for name, value in manifest_variables(workload).items():
        if value.startswith("/etc/flywheel/"):
            local = tmp_path / value.removeprefix("/etc/flywheel/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(_FILES.get(local.name, "x"))
            value = str(local)
        env[name] = value
    return load_settings(env=env, config_file=K8S / "base" / "flywheel.toml")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_loads_its_settings_and_listens_where_its_manifest_says(overlay, tmp_path):
    resources = with_kafka_component(overlay)
    for w in workloads(resources):
        r = role(w)
        settings = role_settings(w, tmp_path / w["metadata"]["name"])
        section = getattr(settings, "serve" if r == "serve" else r)
        assert section.host == "0.0.0.0", f"{r} listens on loopback only"
        ports = pod_spec(w)["containers"][0]["ports"]
        # serving's /metrics on a port of its own, never the API's (serve.metrics_port)
        want = [section.port, section.metrics_port] if r == "serve" else [section.port]
        assert [p["containerPort"] for p in ports] == want, r
        assert settings.kafka.security_protocol == "SASL_SSL" and settings.kafka.sasl_password == "pw"
        services = [s for s in resources if s["kind"] == "Service" and s["spec"]["selector"] ==
                    w["spec"]["selector"]["matchLabels"]]
        assert [p["targetPort"] for s in services for p in s["spec"]["ports"]] == [ports[0]["name"]]


def serving_paths() -> set[str]:
    """The GET routes serving/app.py declares (its app needs engines to build)."""
    import serving.app

    tree = ast.parse(inspect.getsource(serving.app))
    return {d.args[0].value for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef)
            for d in node.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "get"}


def release_paths(tmp_path: Path) -> set[str]:
    from release.api import make_app
    from release.store import ReleaseStore

    store = ReleaseStore(f"sqlite:///{tmp_path / 'release.sqlite3'}")
    try:
        return {r.path for r in make_app(store, Settings().release).routes}
    finally:
        store.close()


def test_every_probe_path_is_a_route_of_its_role(tmp_path):
    paths = {"serve": serving_paths(), "release": release_paths(tmp_path), "ingest": set(OPS_PATHS),
             "reward": set(OPS_PATHS), "trainer": set(OPS_PATHS)}
    assert {"/livez", "/readyz", "/health"} <= paths["serve"] & paths["release"] & paths["ingest"]
    for w in workloads(rendered("gpu")):
        c = pod_spec(w)["containers"][0]
        probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c}
        assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for kind, probe in probes.items():
            assert probe["httpGet"]["path"] in paths[role(w)], f"{w['metadata']['name']} {kind}"
            assert probe["httpGet"]["port"] in {p["name"] for p in c["ports"]}


def test_grace_periods_cover_what_each_role_does_on_sigterm(tmp_path):
    from flywheel.stream.runner import STOP_CLOSE_MS, STOP_FLUSH_S
    from serving.recorder import Recorder
    from trainer.loop import STOP_WAIT_S

    recorder_stop_s = inspect.signature(Recorder.stop).parameters["timeout_s"].default
    for w in workloads(rendered("gpu")):
        spec, r = pod_spec(w), role(w)
        grace = spec["terminationGracePeriodSeconds"]
        settings = role_settings(w, tmp_path / w["metadata"]["name"])
        if r == "serve":
            pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert grace >= pre_stop + settings.serve.drain_s + recorder_stop_s + 5
        elif r in ("ingest", "reward"):
            assert grace >= STOP_FLUSH_S + STOP_CLOSE_MS / 1000 + 30  # and the turn in progress
        elif r == "trainer":
            assert grace >= 2 * STOP_WAIT_S + 60  # and the last version's write
        else:
            assert grace >= settings.release.tick_s + 10


def test_pods_run_unprivileged_without_service_links_and_with_bounds():
    for overlay in OVERLAYS:
        resources = rendered(overlay)
        budgets = [r["spec"]["selector"]["matchLabels"] for r in resources if r["kind"] == "PodDisruptionBudget"]
        for w in workloads(resources):
            spec = pod_spec(w)
            assert spec["enableServiceLinks"] is False
            assert spec["securityContext"]["runAsNonRoot"] is True
            c = spec["containers"][0]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
            assert w["spec"]["selector"]["matchLabels"] in budgets
            assert c["image"] == f"flywheel:{overlay}"
        gpus = {w["metadata"]["name"] for w in workloads(resources)
                if "nvidia.com/gpu" in pod_spec(w)["containers"][0]["resources"]["limits"]}
        assert gpus == ({"flywheel-serving", "flywheel-trainer"} if overlay == "gpu" else set())


def test_stream_stages_share_their_state_and_archive_so_their_pods_can_move(tmp_path):
    """Ingest and reward run as Deployments: their state in the shared database (no shard list,
    which settings refuse beside it), their archive on a volume every replica mounts, and no more
    replicas than partitions (a replica beyond them would hold none)."""
    resources = rendered("cpu")
    claims = {r["metadata"]["name"]: r for r in resources if r["kind"] == "PersistentVolumeClaim"}
    stages = [w for w in workloads(resources) if role(w) in ("ingest", "reward")]
    assert sorted(role(w) for w in stages) == ["ingest", "reward"]
    for w in stages:
        assert w["kind"] == "Deployment"
        settings = role_settings(w, tmp_path / w["metadata"]["name"])
        assert settings.stream.database_url.startswith("postgresql://")
        assert not getattr(settings, role(w)).shards
        assert w["spec"]["replicas"] <= settings.kafka.partitions
        spec = pod_spec(w)
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        archive = next(v for v in spec["volumes"] if v["name"] == mounts[str(settings.data_dir / "archive")])
        claim = claims[archive["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_configmap_is_flywheel_config_example():
    from cli.configdoc import example_toml

    assert (K8S / "base" / "flywheel.toml").read_text() == example_toml(), \
        "regenerate it: flywheel config example > deploy/k8s/base/flywheel.toml"


# -- signing keys as deployed: rotation by key id (docs/signing.md) -------------------------------
def _secret_mounts(workload: dict[str, Any]) -> dict[str, str]:
    """mountPath -> Secret name, for each Secret the workload's container mounts whole."""
    spec = pod_spec(workload)
    whole = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", [])
             if "secret" in v and "items" not in v["secret"]}
    return {m["mountPath"]: whole[m["name"]] for m in spec["containers"][0]["volumeMounts"] if m["name"] in whole}


#: What each key Secret holds halfway through a rotation of the controller's key, as docs/deploy.md
#: makes them (``--from-file=./keys/<key id>.<ext>``: the file's name is the key id).
MID_ROTATION = {"flywheel-release-key": ["release-2027-01.key"],
                "flywheel-release-public-keys": ["release-2026-11.pub", "release-2027-01.pub"],
                "flywheel-trainer-key": ["trainer-2026-11.key"],
                "flywheel-trainer-public-keys": ["trainer-2026-11.pub"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_signing_keys_rotate_by_key_id_as_deployed(overlay, tmp_path):
    """The manifests named the key ids (``release.key``, ``trainer.key``), so a rotation reused an
    id, and every record the new key signed was ``bad_signature`` until every reader changed its
    keys. Now each key setting is a Secret's directory: the signer takes the one ``<id>.key`` the
    Secret holds, the readers trust every ``<id>.pub``, old and new together."""
    import shutil

    from flywheel.signing import Signer, Verifier, generate_key_pair

    keys = tmp_path / "keys"
    for key_id in ("release-2026-11", "release-2027-01", "trainer-2026-11"):
        generate_key_pair(keys, key_id)
    signers, readers = {}, {}
    for w in workloads(with_kafka_component(overlay)):
        r, mounts = role(w), _secret_mounts(w)
        for name, value in manifest_variables(w).items():
            if not name.endswith(("_SIGNING_KEY", "_TRUSTED_RELEASE_KEYS", "_TRUSTED_CHECKPOINT_KEYS")):
                continue
            assert value in mounts, f"{r}: {name}={value} is not a mounted Secret's directory (it names a key id)"
            local = tmp_path / r / mounts[value]
            local.mkdir(parents=True)
            for f in MID_ROTATION[mounts[value]]:
                shutil.copy(keys / f, local / f)
            if name.endswith("_SIGNING_KEY"):
                signers[r] = Signer.load(local, setting=name)
            else:
                readers[r] = Verifier.load([local], setting=name)
    assert {r: s.key_id for r, s in signers.items()} == {"release": "release-2027-01", "trainer": "trainer-2026-11"}
    assert readers["serve"].key_ids() == ("release-2026-11", "release-2027-01")
    value = b'{"kind":"release"}'
    for signer in (Signer.load(keys / "release-2026-11.key"), signers["release"]):  # the old key's and the new
        assert readers["serve"].check(value, signer.headers(value)) == signer.key_id
    assert readers["release"].check(value, signers["trainer"].headers(value)) == "trainer-2026-11"


def test_the_deploy_guide_and_example_secrets_name_keys_by_dated_ids():
    dated = re.compile(r"(release|trainer)-\d{4}-\d{2}\.(key|pub)")
    guide = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    files = re.findall(r"--from-file=(\S+\.(?:key|pub))\b", guide)
    assert files and all(re.fullmatch(r"\./keys/" + dated.pattern, f) for f in files), files
    assert "Rotating the signing keys" in guide
    example = {d["metadata"]["name"]: d.get("stringData", {}) for d in load_docs(K8S / "secrets.example.yaml")}
    assert {n: sorted(example[n]) for n in MID_ROTATION} == {n: sorted(MID_ROTATION[n]) for n in MID_ROTATION} | {
        "flywheel-release-key": ["release-2026-11.key"]}
    assert all(dated.fullmatch(f) for n in MID_ROTATION for f in example[n])


# -- every path a role opens is on a volume of its pod -----------------------------------------------
#: The path settings each role opens, and whether it writes there (False: it only reads, so its
#: mount is read-only). ``model_dir`` is also the LoRA base: the trainer trains an adapter on it and
#: the release gate applies adapter versions to it. ``trainer.store`` in serving: a release record
#: names versions by their path in the controller's store, so serving mounts it where that is.
ROLE_PATHS: dict[str, dict[str, bool]] = {
    "serve": {"model_dir": False, "trainer.store": False, "data_dir": True, "serve.trusted_release_keys": False},
    "trainer": {"model_dir": False, "trainer.store": True, "data_dir": True, "trainer.signing_key": False,
                "trainer.deepspeed_config": False, "trainer.reference_dir": False},
    "release": {"model_dir": False, "trainer.store": False, "data_dir": True, "release.signing_key": False,
                "release.trusted_checkpoint_keys": False, "release.prompts_file": False},
    "ingest": {"data_dir": True, "archive": True},
    "reward": {"data_dir": True, "archive": True},
}
#: Read by every role that talks to the broker.
COMMON_PATHS = {"kafka.ssl_cafile": False, "kafka.ssl_certfile": False, "kafka.ssl_keyfile": False}


#: Path settings whose files must exist while the settings load (settings check them).
_CHECKED_AT_LOAD = ("FLYWHEEL_KAFKA_SSL_CAFILE", "FLYWHEEL_KAFKA_SSL_CERTFILE", "FLYWHEEL_KAFKA_SSL_KEYFILE")


def pod_settings(workload: dict[str, Any], resources: list[dict[str, Any]],
                 tmp_path: Path) -> tuple[Settings, dict[str, str]]:
    """The settings a pod's process loads, as the kubelet starts it: the image's ENV (from
    deploy/Dockerfile), then the container's env and envFrom, then the mounted ConfigMap's TOML.
    Every path setting keeps its value in the pod but the files read or checked while the settings
    load (``*_FILE`` secrets, the TOML, the Kafka TLS files), made here; the second value maps
    each of those back to its path in the pod."""
    from k8s_render import image_env

    c = pod_spec(workload)["containers"][0]
    maps = {r["metadata"]["name"]: r.get("data", {}) for r in resources if r["kind"] == "ConfigMap"}
    env = image_env(K8S.parents[1] / "deploy" / "Dockerfile")
    for source in c.get("envFrom", []):
        if "configMapRef" not in source:  # a Secret's values are not in the manifests: say so, never guess
            pytest.fail(f"{workload['metadata']['name']}: envFrom {source} is not a ConfigMap this test can read")
        env.update(maps[source["configMapRef"]["name"]])
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        env[e["name"]] = maps[ref["name"]][ref["key"]] if ref else e.get("value", "")
    made = {}
    for name, value in list(env.items()):
        if name.endswith(FILE_SUFFIX) or name in _CHECKED_AT_LOAD:
            local = tmp_path / "files" / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(_FILES.get(Path(value).name, "x"))
            env[name], made[str(local)] = str(local), value
    config = next(m for m in c["volumeMounts"] if m["mountPath"] == env["FLYWHEEL_CONFIG"])
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == config["name"])
    toml = tmp_path / "flywheel.toml"
    toml.write_text(maps[volume["configMap"]["name"]][config["subPath"]])
    return load_settings(env={**env, "FLYWHEEL_CONFIG": str(toml)}), made


def path_values(settings: Settings, setting: str) -> list[str]:
    """The pod paths one path setting names (none when unset). ``trainer.store``: the local
    store's directory, which with an object store's URL is the trainer's working copy and the
    controller's cache of fetched versions (flywheel/checkpoints/store.py store_root)."""
    from flywheel.checkpoints.store import store_root

    if setting == "trainer.store":
        return [str(store_root(settings))]
    if setting == "archive":
        return [str(settings.archive_root)]
    value: Any = settings
    for part in setting.split("."):
        value = getattr(value, part)
    values = value if isinstance(value, tuple) else (value,)
    return [str(v) for v in values if v is not None and str(v)]


def covering_mount(workload: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount a path is on: the deepest mount path that holds it."""
    mounts = [m for m in pod_spec(workload)["containers"][0]["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def with_object_store(overlay: str, tmp_path: Path) -> list[dict[str, Any]]:
    """``overlay`` with components/object-store, as an operator's overlay adds it. Rendered by
    ``kubectl kustomize`` only: the component is strategic-merge patches (a mount deleted by its
    path, whatever its index), which tests/k8s_render.py does not apply."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: components/object-store is rendered by kustomize itself")
    folder = tmp_path / f"{overlay}-with-object-store"
    folder.mkdir(parents=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, folder)],
        "components": [os.path.relpath(K8S / "components" / "object-store", folder)]}))
    return kustomize(folder)


@pytest.mark.parametrize("overlay", [*OVERLAYS, "cpu+object-store"])
def test_every_path_a_role_opens_is_on_a_volume_of_its_pod(overlay, tmp_path):
    """The release controller's pod set no model directory and mounted none, so it took the image's
    ``/models/current``, which no volume of its pod holds: every gate against version 0 raised
    OSError and each version was rejected after three tries. Each role's settings load here as its
    pod's would, and every path they name for the role must be on one of the pod's mounts,
    read-only where the role only reads. A checkpoint store that is a directory is a mounted one;
    an object store's URL needs no claim, but its local side (the trainer's working copy, the
    controller's cache) is written, on a volume of the pod."""
    from flywheel.checkpoints.remote import is_url

    base, _, component = overlay.partition("+")
    resources = with_object_store(base, tmp_path) if component else kustomize(K8S / "overlays" / overlay)
    kafka = yaml.safe_load((K8S / "components" / "kafka-sasl-ssl" / "kustomization.yaml").read_text())
    missing = []
    for w in workloads(apply_patches(resources, kafka["patches"])):
        r = role(w)
        settings, made = pod_settings(w, resources, tmp_path / w["metadata"]["name"])
        if r in ("serve", "trainer", "release"):  # ingest and reward read no checkpoint
            assert is_url(settings.trainer.store) == bool(component), (r, settings.trainer.store)
        for setting, writes in (ROLE_PATHS[r] | COMMON_PATHS).items():
            if setting == "trainer.store" and is_url(settings.trainer.store):
                if r == "serve":  # serving fetches into <data_dir>/serving, and opens no store
                    continue
                writes = True
            for path in (made.get(p, p) for p in path_values(settings, setting)):
                mount = covering_mount(w, path)
                if mount is None:
                    missing.append(f"{r}: {setting}={path} is on no volume of the pod")
                elif bool(mount.get("readOnly")) == writes:
                    missing.append(f"{r}: {setting}={path} is on {mount['mountPath']} mounted "
                                   f"{'read-only, but the role writes there' if writes else 'writable, but the role only reads'}")
    assert not missing, "\n".join(missing)


def test_the_object_store_component_takes_every_checkpoint_off_the_claims(tmp_path):
    """components/object-store (docs/deploy.md, "Checkpoints on an object store"): no
    flywheel-checkpoints claim is rendered or mounted; the trainer, the controller and serving
    load ``trainer.store`` as the ConfigMap's s3:// URL, with ``AWS_ENDPOINT_URL`` from it and the
    credentials as botocore's shared credentials file on a read-only mount of the Secret (no key
    in the environment); the model is on a claim of its own, read-only. Every object is valid
    Kubernetes."""
    resources = with_object_store("cpu", tmp_path)
    for res in resources:
        kubernetes_validate.validate(res, "1.37.0", strict=True)
    claims = {r["metadata"]["name"] for r in resources if r["kind"] == "PersistentVolumeClaim"}
    assert claims == {"flywheel-archive", "flywheel-model"}
    config = next(r["data"] for r in resources
                  if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith("flywheel-object-store-"))
    assert config["FLYWHEEL_TRAINER_STORE"].startswith("s3://") and config["AWS_ENDPOINT_URL"].startswith("http")
    readers = set()
    for w in workloads(resources):
        spec, r = pod_spec(w), role(w)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "flywheel-checkpoints" not in {v["persistentVolumeClaim"]["claimName"] for v in volumes.values()
                                              if "persistentVolumeClaim" in v}, r
        if r not in ("serve", "trainer", "release"):
            continue
        readers.add(r)
        settings, _ = pod_settings(w, resources, tmp_path / w["metadata"]["name"])
        assert settings.trainer.store == config["FLYWHEEL_TRAINER_STORE"], r
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        endpoint = env["AWS_ENDPOINT_URL"]["valueFrom"]["configMapKeyRef"]
        assert config[endpoint["key"]] == config["AWS_ENDPOINT_URL"], r
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), r
        credentials = env["AWS_SHARED_CREDENTIALS_FILE"]["value"]
        mount = covering_mount(w, credentials)
        secret = volumes[mount["name"]]["secret"]
        assert mount.get("readOnly") and secret["secretName"] == "flywheel-object-store", r
        assert {"key": "credentials", "path": os.path.relpath(credentials, mount["mountPath"])} in secret["items"], r
        model = covering_mount(w, str(settings.model_dir))
        assert model.get("readOnly") and volumes[model["name"]]["persistentVolumeClaim"]["claimName"] == \
            "flywheel-model", r
    assert readers == {"serve", "trainer", "release"}
