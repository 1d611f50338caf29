"""The tree passes ruff with the project's settings (pyproject.toml), so `make lint` stays green."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    venv_ruff = Path(sys.executable).with_name("ruff")  # the pinned dev tool, not a system one
    ruff = str(venv_ruff) if venv_ruff.exists() else shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: it is in the dev extra (`make install`)")
    out = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout[-4000:]
