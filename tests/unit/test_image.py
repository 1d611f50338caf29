"""deploy/Dockerfile read as text: no container engine runs where the suite does, so the image
is never built here (tests/integration/test_wheel.py runs the wheel it is made of). What can be
held without building it: the runtime stage installs the wheel and copies no source, runs as a
non-root user, and takes the base image and the extra as build arguments."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.MULTILINE)]


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, args in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            current = args.split()[-1] if " AS " in args.upper() else args
            out[current] = [(op, args)]
        elif current is not None:
            out[current].append((op, args))
    return out


def test_the_runtime_stage_installs_the_built_wheel_and_no_source():
    built = stages()
    assert list(built) == ["builder", "runtime"]
    assert any(op == "RUN" and "pip wheel" in args and "--no-deps" in args for op, args in built["builder"])
    runtime = built["runtime"]
    assert runtime[0] == ("FROM", "${BASE_IMAGE} AS runtime")
    assert not [args for op, args in runtime if op in ("COPY", "ADD") and "--from=builder" not in args], \
        "the runtime stage copies from the build context"
    installs = [args for op, args in runtime if op == "RUN" and "pip install" in args and "flywheel-*.whl" in args]
    assert installs and "from=builder,source=/wheels" in installs[0]
    assert "[${EXTRA},s3]" in installs[0] and "demo" not in installs[0]  # a production install, s3:// ready


def test_base_image_and_extra_are_build_arguments():
    text = DOCKERFILE.read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    assert re.search(r"^ARG EXTRA=cpu$", text, re.MULTILINE)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"cpu", "gpu"} <= extras.keys() and "case \"$EXTRA\" in cpu|gpu)" in text


def test_it_runs_as_a_user_that_is_not_root():
    runtime = stages()["runtime"]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["flywheel"]') in runtime


def test_the_build_context_leaves_out_what_no_wheel_holds():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "data", "tests"} <= ignored
    # and keeps everything the wheel is built from
    kept = ["pyproject.toml", "README.md", "flywheel", "cli", "local", "serving", "ingest", "reward", "trainer",
            "release"]
    assert not ignored & set(kept)


def test_the_header_says_why_the_suite_does_not_build_it():
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    assert "no container engine runs" in header and "tests/integration/test_wheel.py" in header
