"""A kubelet for tests: the rendered manifests of deploy/k8s run as processes on this machine.

No cluster and no container engine run where the tests run, so this is the closest the suite comes
to ``kubectl apply -k``: every Deployment's pods are started the way a kubelet starts them, from
the rendered objects and nothing else, and the harness stays out of what the manifests decide.

- **Rendering**: ``kubectl kustomize`` (tests/k8s_render.py only where kubectl is absent).
- **Command**: the image's ENTRYPOINT (``flywheel``, the console script of the venv this runs in:
  the image is the wheel and nothing else) unless the container's ``command`` replaces it, then its
  ``args`` (or the image's CMD).
- **Environment**: the image's ENV read from deploy/Dockerfile, then ``envFrom``, then ``env``
  (``value``, ``valueFrom`` ConfigMap and Secret keys, an ``optional`` one that is missing left
  unset, ``$(VAR)`` expanded), as the kubelet orders them; ``HOME`` the image user's home when
  the pod sets none, as container runtimes set it.
  ``enableServiceLinks`` true would add the Services' variables: the manifests turn it off, and a
  pod that leaves it on is refused here rather than given invented addresses.
- **Filesystem**: each pod has a root directory that stands for the image's root filesystem; every
  absolute path in the environment is read under it (``/etc/flywheel/x`` -> ``<root>/etc/flywheel/x``).
  Each volumeMount is a symbolic link at its mountPath to the volume's directory: a
  PersistentVolumeClaim is one directory shared by every pod that mounts it (``subPath`` a folder
  in it), an emptyDir a directory of the pod's own (kept across container restarts, wiped when
  the pod is deleted), a ConfigMap or Secret a directory of its keys (``items`` and modes
  honoured, less the write bits). Read-only: a ``readOnly`` mount links to a view of the volume
  that the container's own mount namespace binds read-only over it, and so is the pod's root
  with ``readOnlyRootFilesystem`` (``unshare``, as root); without root, the write bits are off and
  :meth:`Pod.writes_outside_mounts` finds afterwards what the container wrote where it may not.
- **Ports**: pods here share one loopback, so each containerPort gets a free port of its own, and
  the variable that names the role's port (``*_PORT`` whose value is the containerPort) gets it.
  Service DNS names (``kafka-bootstrap.kafka.svc:9092``) are mapped by the test to loopback
  addresses, as cluster DNS would map them to Service IPs.
- **Probes**: startup, liveness and readiness are polled at their periods and thresholds over HTTP;
  a liveness (or startup) failure restarts the container (SIGTERM, the grace period, SIGKILL).
- **Pods come and go**: :meth:`Cluster.delete_pod` stops a pod with its grace period and wipes its
  emptyDirs, and its Deployment gets a new pod; :meth:`Cluster.rollout_restart` replaces a
  Deployment's pods one step at a time by its ``maxSurge`` and ``maxUnavailable``.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from flywheel.processes import kill_group

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def render(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize folder`` makes; tests/k8s_render.py where kubectl is absent."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        from k8s_render import render as render_in_python

        return render_in_python(folder)
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=False, timeout=60)
    if out.returncode != 0:
        raise ValueError(f"kubectl kustomize {folder} failed: {out.stderr[-2000:]}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def image_env(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The runtime stage's ENV (the last FROM's), as the image carries it: ``$PATH`` left for the
    caller to resolve. Continuation lines are joined; ``KEY=value`` pairs only."""
    text = dockerfile.read_text().replace("\\\n", " ")
    stages = re.split(r"(?m)^FROM\s", text)
    env: dict[str, str] = {}
    for line in stages[-1].splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", line[4:]):
                env[key] = value
    return env


def image_home(dockerfile: Path = DOCKERFILE) -> str:
    """The home directory of the image's user (its ``useradd --home-dir``), ``/`` if none."""
    found = re.search(r"--home-dir\s+(\S+)", dockerfile.read_text())
    return found.group(1) if found else "/"


def _expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: a variable defined before it, else left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


@dataclass
class Probe:
    """One of a container's probes: an HTTP GET on a named or numbered port."""

    kind: str
    path: str
    port: int
    period_s: float
    timeout_s: float
    failures: int
    successes: int = 1

    @classmethod
    def of(cls, kind: str, spec: dict[str, Any], ports: dict[Any, int]) -> Probe:
        get = spec["httpGet"]
        return cls(kind, get["path"], ports[get["port"]], spec.get("periodSeconds", 10), spec.get("timeoutSeconds", 1),
                   spec.get("failureThreshold", 3), spec.get("successThreshold", 1))

    def ok(self) -> bool:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}{self.path}", timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return 200 <= r.status_code < 400


@dataclass
class Pod:
    """One pod of a Deployment: its directories, its container's process, and its probes."""

    name: str
    deployment: str
    spec: dict[str, Any]
    cluster: Cluster
    dir: Path
    ports: dict[Any, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    ready: bool = False
    started: bool = False
    restarts: int = 0
    deleted: bool = False
    _made: set[Path] = field(default_factory=set)
    _read_only: dict[Path, str] = field(default_factory=dict)
    #: (volume, view): bound read-only in the container's mount namespace
    _binds: list[tuple[Path, Path]] = field(default_factory=list)
    _found: list[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def container(self) -> dict[str, Any]:
        return self.spec["containers"][0]

    def port(self, name: str) -> int:
        """The loopback port that stands for this pod's containerPort ``name``."""
        return self.ports[name]

    def url(self, name: str = "http") -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    # -- setting up, as the kubelet does before the container starts ------------------------------
    def prepare(self) -> None:
        if self.spec.get("enableServiceLinks", True) is not False:
            raise ValueError(f"{self.name}: enableServiceLinks is on: Kubernetes would inject every Service's "
                             "<NAME>_SERVICE_HOST/_PORT variables, which this harness does not make up")
        for p in self.container.get("ports", []):
            port = free_port()
            self.ports[p["containerPort"]] = port
            if "name" in p:
                self.ports[p["name"]] = port
        self.root.mkdir(parents=True)
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        # parents before children: a mount inside another (the archive inside the data dir) is a
        # link inside that volume's directory, as a mount over a directory of the parent mount
        for m in sorted(self.container.get("volumeMounts", []), key=lambda m: len(Path(m["mountPath"]).parts)):
            self._mount(m, volumes[m["name"]])
        workdir = self.root / "home" / "flywheel"  # the image's WORKDIR, in its read-only root
        workdir.mkdir(parents=True, exist_ok=True)
        if self.container.get("securityContext", {}).get("readOnlyRootFilesystem") and _can_isolate():
            self._binds.append((self.root, self.root))  # the mounts are links out of it: they stay as mounted
        self._made = set(self._walk_root())

    def _mount(self, mount: dict[str, Any], volume: dict[str, Any]) -> None:
        source = self.cluster.volume_dir(self, volume)
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():  # the kubelet makes a missing subPath a directory
                source.mkdir(parents=True)
        target = self.root / mount["mountPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            raise ValueError(f"{self.name}: {mount['mountPath']} is mounted twice")
        read_only = bool(mount.get("readOnly")) or "configMap" in volume or "secret" in volume
        if read_only and ("configMap" in volume or "secret" in volume):
            # this pod's own copy, which nobody else writes: any change is the container's
            for f in ([source] if source.is_file() else [p for p in source.rglob("*") if p.is_file()]):
                self._read_only[f] = _digest(f)
        if read_only and _can_isolate():
            # a view of the volume of this pod's own, bound read-only over it in the container's
            # mount namespace (see argv): a claim another pod writes stays writable there
            view = self.dir / "views" / str(len(self._binds))
            view.parent.mkdir(parents=True, exist_ok=True)
            view.mkdir() if source.is_dir() else view.touch()
            self._binds.append((source, view))
            source = view
        target.symlink_to(source)

    def environment(self) -> dict[str, str]:
        """The container's environment, as the kubelet makes it, with its paths read under the
        pod's root and its port and Service addresses mapped to loopback."""
        c = self.container
        env = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ", "USER", "LOGNAME")}
        image = image_env()
        image_path = image.pop("PATH", "").replace("$PATH", os.environ.get("PATH", ""))
        env["PATH"] = image_path.replace("/opt/flywheel/bin", str(Path(sys.executable).parent))
        made: dict[str, str] = dict(image)
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef") or src.get("secretRef")
            data = self.cluster.data_of("ConfigMap" if "configMapRef" in src else "Secret", ref["name"])
            made.update({src.get("prefix", "") + k: v for k, v in data.items()})
        for e in c.get("env", []):
            if "value" in e:
                made[e["name"]] = _expand(e["value"], made)
            else:
                ref = e["valueFrom"].get("secretKeyRef") or e["valueFrom"]["configMapKeyRef"]
                kind = "Secret" if "secretKeyRef" in e["valueFrom"] else "ConfigMap"
                data = self.cluster.data_of(kind, ref["name"])
                if ref["key"] in data:
                    made[e["name"]] = data[ref["key"]]
                elif not ref.get("optional"):  # the kubelet does not start the container
                    raise KeyError(f"{self.name}: {kind} {ref['name']} has no key {ref['key']}")
        # the container runtime sets HOME to the image user's home when the pod does not: in the
        # read-only root, so what a role caches there is a write refused
        made.setdefault("HOME", image_home())
        for name, value in made.items():
            env[name] = self._localise(name, value)
        return env

    def _localise(self, name: str, value: str) -> str:
        if value.startswith("/"):
            return str(self.root / value.lstrip("/"))
        if name.endswith("_PORT") and value.isdigit() and int(value) in self.ports:
            return str(self.ports[int(value)])
        for service, address in self.cluster.services.items():
            value = value.replace(service, address)
        return value

    def argv(self) -> list[str]:
        """The container's command: ENTRYPOINT or ``command``, then CMD or ``args``; run in a
        mount namespace of its own where read-only mounts are bound read-only, as the kernel
        refuses a container's writes to them (root only; elsewhere :meth:`writes_outside_mounts`
        checks afterwards what the container wrote)."""
        c = self.container
        flywheel = str(Path(sys.executable).parent / "flywheel")  # the image's ENTRYPOINT ["flywheel"]
        entry = [flywheel if w == "flywheel" else w for w in c.get("command") or ["flywheel"]]
        argv = [*entry, *c.get("args", ["--help"])]
        if not self._binds:
            return argv
        binds = " && ".join(f"mount --bind -o ro '{src}' '{dst}'" for src, dst in self._binds)
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{binds} && exec "$@"', "sh", *argv]

    # -- running -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.started = self.ready = False
        log_file = (self.dir / "container.log").open("ab")
        self.proc = subprocess.Popen(self.argv(), env=self.environment(), cwd=self.root / "home" / "flywheel",
                                     stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, up to the pod's grace period, then SIGKILL of what is left of its group."""
        if self.proc is None:
            return None
        grace = self.spec.get("terminationGracePeriodSeconds", 30) if grace_s is None else grace_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_group(self.proc.pid)
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = self.dir / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def writes_outside_mounts(self) -> list[str]:
        """Files the container made in the image's (read-only) root filesystem, and read-only
        mounts' files it changed: what ``readOnlyRootFilesystem`` and ``readOnly`` refuse. A
        deleted pod's, as they were when it was deleted."""
        if self.deleted and self._found is not None:
            return self._found
        made = sorted(str(p.relative_to(self.root)) for p in self._walk_root() if p not in self._made)
        changed = sorted(str(f) for f, digest in self._read_only.items() if not f.exists() or _digest(f) != digest)
        return made + changed

    def _walk_root(self) -> list[Path]:
        out = []
        for top, dirs, files in os.walk(self.root):  # os.walk does not follow the mounts' links
            out += [Path(top) / n for n in dirs + files]
        return out

    def probe_loop(self, stop: threading.Event) -> None:
        """The kubelet's probing of this pod's container, until ``stop`` or the pod is deleted."""
        c = self.container
        probes = {k: Probe.of(k, c[k], self.ports) for k in ("startupProbe", "livenessProbe", "readinessProbe")
                  if k in c}
        fails = dict.fromkeys(probes, 0)
        due = dict.fromkeys(probes, time.monotonic() + 1.0)
        while not stop.is_set() and not self.deleted:
            now = time.monotonic()
            for kind, probe in probes.items():
                if now < due[kind] or (kind != "startupProbe" and "startupProbe" in probes and not self.started):
                    continue
                if kind == "startupProbe" and self.started:
                    continue
                due[kind] = now + probe.period_s
                ok = self.alive() and probe.ok()
                fails[kind] = 0 if ok else fails[kind] + 1
                if kind == "startupProbe":
                    self.started = ok
                elif kind == "readinessProbe":
                    if ok:
                        self.ready = self.started = True
                    elif fails[kind] >= probe.failures:
                        self.ready = False
                if not ok and kind in ("startupProbe", "livenessProbe") and fails[kind] >= probe.failures:
                    self._restart(f"{kind} failed {fails[kind]} times")
                    fails = dict.fromkeys(probes, 0)
                    due = dict.fromkeys(probes, time.monotonic() + 1.0)
                    break
            if self.proc is not None and self.proc.poll() is not None and not self.deleted:
                self._restart(f"exited with {self.proc.returncode}")  # restartPolicy: Always
                fails = dict.fromkeys(probes, 0)
            stop.wait(0.2)

    def _restart(self, why: str) -> None:
        with self._lock:
            if self.deleted:
                return
            log.warning("kubelet: restarting %s: %s", self.name, why)
            self.cluster.events.append(f"{self.name} restarted: {why}")
            self.stop()
            self.restarts += 1
            self.start()


def _can_isolate() -> bool:
    """Whether containers get a mount namespace of their own, where read-only mounts are bound
    read-only (root, with util-linux's unshare)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def _remove(folder: Path) -> None:
    """``folder`` and all in it, the read-only volumes' directories included."""
    for top, dirs, _ in os.walk(folder):
        for d in dirs:
            if not (Path(top) / d).is_symlink():
                (Path(top) / d).chmod(0o755)
    shutil.rmtree(folder, ignore_errors=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: Ports handed to pods in this process: never handed twice.
_HANDED: set[int] = set()


def free_port() -> int:
    """A loopback port free now and below the kernel's ephemeral range. A port the kernel picked
    for a bind to 0 is from that range, the one outgoing connections draw from too: a Kafka client
    connecting between the pick and the pod's bind took it, and the pod failed on "Address already
    in use" at every restart while that connection lasted (a clean-clone run)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12_000), low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free loopback port below {low}")


class Cluster:
    """The rendered ``resources`` run as pods under ``root``. ``secrets``: each Secret's keys, as
    the operator creates them; ``services``: Service DNS address -> loopback address."""

    def __init__(self, resources: list[dict[str, Any]], root: Path, *, secrets: dict[str, dict[str, str]],
                 services: dict[str, str]) -> None:
        self.resources, self.root, self.secrets, self.services = resources, root, secrets, services
        self.pods: list[Pod] = []
        self.events: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._names = itertools.count(1)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def deployments(self) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["kind"] == "Deployment"]

    def deployment(self, name: str) -> dict[str, Any]:
        return next(d for d in self.deployments() if d["metadata"]["name"] == name)

    def data_of(self, kind: str, name: str) -> dict[str, str]:
        if kind == "Secret":
            if name not in self.secrets:
                raise KeyError(f"Secret {name} does not exist: the pod would stay in ContainerCreating")
            return self.secrets[name]
        cm = next(r for r in self.resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name)
        return cm.get("data", {})

    def volume_dir(self, pod: Pod, volume: dict[str, Any]) -> Path:
        """The directory that stands for ``volume`` in ``pod`` (made on first use)."""
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if not any(r["kind"] == "PersistentVolumeClaim" and r["metadata"]["name"] == claim for r in self.resources):
                raise KeyError(f"{pod.name}: claim {claim} is in no rendered PersistentVolumeClaim")
            d = self.root / "volumes" / claim
            d.mkdir(parents=True, exist_ok=True)
            return d
        d = pod.dir / "volumes" / volume["name"]
        if d.exists():
            return d
        d.mkdir(parents=True)
        if "emptyDir" in volume:
            return d
        kind, ref = ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
        data = self.data_of(kind, ref.get("name") or ref["secretName"])
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            f = d / item["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(data[item["key"]])
            # read-only for whom permissions bind (not root: see Pod.argv)
            f.chmod(item.get("mode", ref.get("defaultMode", 0o644)) & 0o555)
        d.chmod(0o555)
        return d

    # -- pods --------------------------------------------------------------------------------------
    def start_pod(self, deployment: dict[str, Any]) -> Pod:
        name = f"{deployment['metadata']['name']}-{next(self._names)}"
        pod = Pod(name, deployment["metadata"]["name"], copy.deepcopy(deployment["spec"]["template"]["spec"]),
                  self, self.root / "pods" / name)
        pod.prepare()
        pod.start()
        self.pods.append(pod)
        t = threading.Thread(target=pod.probe_loop, args=(self._stop,), name=f"kubelet-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return pod

    def apply(self, *, skip: tuple[str, ...] = ()) -> None:
        """Every Deployment's replicas started (but those of the Deployments named in ``skip``)."""
        for d in self.deployments():
            if d["metadata"]["name"] in skip:
                continue
            for _ in range(d["spec"].get("replicas", 1)):
                self.start_pod(d)

    def pods_of(self, deployment: str) -> list[Pod]:
        return [p for p in self.pods if p.deployment == deployment and not p.deleted]

    def delete_pod(self, pod: Pod, *, grace_s: float | None = None, replace: bool = True) -> Pod | None:
        """``kubectl delete pod``: its container stopped with its grace period (``grace_s=0``: a
        kill), its emptyDirs gone; the Deployment's controller makes a new pod for it."""
        with pod._lock:
            pod.deleted = True
        pod.stop(grace_s)
        pod._found = pod.writes_outside_mounts()  # before its volumes go
        _remove(pod.dir / "volumes")
        self.events.append(f"{pod.name} deleted")
        return self.start_pod(self.deployment(pod.deployment)) if replace else None

    def rollout_restart(self, deployment: str, *, timeout_s: float = 300.0) -> list[Pod]:
        """``kubectl rollout restart``: by the strategy's maxSurge (new pods started and ready)
        and maxUnavailable (old pods deleted), until every pod is new."""
        d = self.deployment(deployment)
        rolling = d["spec"].get("strategy", {}).get("rollingUpdate", {})
        surge, unavailable = int(rolling.get("maxSurge", 1)), int(rolling.get("maxUnavailable", 0))
        old, new = self.pods_of(deployment), []
        while old:
            for _ in range(min(max(surge, 1), len(old))):
                new.append(self.start_pod(d))
            self.wait_ready(new, timeout_s=timeout_s)
            for pod in old[:max(surge + unavailable, 1)]:
                self.delete_pod(pod, replace=False)
                old.remove(pod)
        return new

    def wait_ready(self, pods: list[Pod] | None = None, *, timeout_s: float = 300.0) -> None:
        pods = self.pods_of_all() if pods is None else pods
        deadline = time.monotonic() + timeout_s
        while not all(p.ready for p in pods):
            if time.monotonic() > deadline:
                raise AssertionError("not ready in time: " + "; ".join(
                    f"{p.name} (restarts {p.restarts}): {p.log()[-1500:]}" for p in pods if not p.ready))
            time.sleep(0.5)

    def pods_of_all(self) -> list[Pod]:
        return [p for p in self.pods if not p.deleted]

    def shutdown(self) -> None:
        self._stop.set()
        live = self.pods_of_all()
        for pod in live:
            pod.deleted = True
        # serving's pods first (no request reaches a pipeline being stopped), then the rest, each
        # group at once, as a namespace deleted stops its pods
        for group in ([p for p in live if p.deployment == "flywheel-serving"],
                      [p for p in live if p.deployment != "flywheel-serving"]):
            stopping = [threading.Thread(target=p.stop, kwargs={"grace_s": 30}) for p in group]
            for t in stopping:
                t.start()
            for t in stopping:
                t.join()
        for t in self._threads:
            t.join(timeout=5)
