"""Claims the docs make about the code and the demo's settings, held to them: a changed setting
fails here until the sentence that states it changes too."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_demo_cadence_the_docs_state_is_local_demo_toml(doc):
    every = tomllib.loads((ROOT / "local" / "demo.toml").read_text())["trainer"]["publish_every_steps"]
    text = (ROOT / doc).read_text()
    # "a version every 10 steps or 60 s" is production's default, not the demo's
    stated = [int(n) for n in re.findall(r"a version every (\d+) steps(?! or)", text)]
    stated += [int(n) for n in re.findall(r"a demo version \((\d+) steps of", text)]
    assert stated, f"{doc} no longer states the demo's cadence: drop this test's case with the sentence"
    assert set(stated) == {every}, f"{doc} says a version every {stated} steps; local/demo.toml: {every}"


def test_no_doc_says_no_process_uses_a_database_server():
    # the release controller can keep its state in PostgreSQL (release/store.py)
    for doc in ("README.md", "docs/architecture.md"):
        assert "No process uses a database" not in (ROOT / doc).read_text(), doc


def test_runbooks_point_to_the_release_controller_not_an_older_model_directory():
    runbooks = ROOT / "dashboards" / "runbooks"
    assert "no release controller" not in (runbooks / "policy-collapse.md").read_text().lower()
    for name in ("serving-errors.md", "policy-collapse.md"):
        text = (runbooks / name).read_text()
        assert "flywheel release undo --to" in text, name
        assert "restart serving on the previous version's directory" not in text, name
    assert "`flywheel-release`" in (runbooks / "process-down.md").read_text()
