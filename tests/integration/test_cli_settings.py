"""The ``flywheel`` command in an orchestrator's environment, through a real process: global flags
after the subcommand, ``--version``, service links and secrets mounted as files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from cli.main import build_parser

pytestmark = pytest.mark.integration


def flywheel(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture
def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}


def test_config_and_log_level_after_the_subcommand_as_before_it(tmp_path, env):
    cfg = tmp_path / "x.toml"
    cfg.write_text('topic_prefix = "from-x."\n[serve]\nport = 7001\n')
    before = flywheel("--config", str(cfg), "--log-level", "error", "config", "show", env=env, cwd=tmp_path)
    after = flywheel("config", "show", "--config", str(cfg), "--log-level", "error", env=env, cwd=tmp_path)
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert before.stdout == after.stdout
    shown = json.loads(after.stdout)
    assert shown["topic_prefix"] == "from-x." and shown["serve"]["port"] == 7001 and shown["log_level"] == "ERROR"
    # the flag beats the environment
    env["FLYWHEEL_LOG_LEVEL"] = "DEBUG"
    assert json.loads(flywheel("config", "show", "--log-level", "warning", env=env, cwd=tmp_path).stdout)[
        "log_level"] == "WARNING"
    bad = flywheel("config", "show", "--log-level", "loud", env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "'loud' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in bad.stderr


def test_every_role_takes_the_global_flags_after_its_name():
    parser = build_parser()
    for argv in (["serve"], ["ingest"], ["reward"], ["train"], ["release", "serve"], ["up"], ["topics"],
                 ["deadletters", "summary"], ["checkpoint", "verify"], ["demo"]):
        args = parser.parse_args([*argv, "--config", "x.toml", "--log-level", "debug"])
        assert (args.config, args.log_level) == (Path("x.toml"), "DEBUG"), argv
        # given before the name and not after, the subcommand keeps it
        args = parser.parse_args(["--config", "y.toml", *argv])
        assert (args.config, args.log_level) == (Path("y.toml"), None), argv
    # a subcommand's own --version (a release version) is not the program's
    assert parser.parse_args(["release", "audit", "--version", "3"]).version == 3


def test_version(tmp_path, env):
    out = flywheel("--version", env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"flywheel {version('flywheel')}"


def test_service_links_warn_once_and_secrets_come_from_files(tmp_path, env):
    """What a Kubernetes pod's environment holds: service links for Services named ``flywheel`` and
    ``flywheel-serve``, and secrets mounted as files."""
    (tmp_path / "api-keys").write_text("sk-from-a-file\n")
    (tmp_path / "salt").write_text("pepper\n")
    env.update({
        "FLYWHEEL_SERVICE_HOST": "10.0.0.1", "FLYWHEEL_SERVICE_PORT": "8000", "FLYWHEEL_PORT": "tcp://10.0.0.1:8000",
        "FLYWHEEL_SERVE_SERVICE_HOST": "10.0.0.2", "FLYWHEEL_SERVE_PORT": "tcp://10.0.0.2:8000",
        "FLYWHEEL_SERVE_PORT_8000_TCP_ADDR": "10.0.0.2",
        "FLYWHEEL_API_KEYS_FILE": str(tmp_path / "api-keys"),
        "FLYWHEEL_SERVE_USER_ID_SALT_FILE": str(tmp_path / "salt"),
    })
    out = flywheel("config", "show", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["serve"]["port"] == 8000
    from flywheel.apikeys import key_id

    assert shown["serve"]["api_keys"] == [key_id("pepper", "sk-from-a-file")]  # the salt from its file too
    warned = [line for line in out.stderr.splitlines() if "service link" in line]
    assert sorted(line.split()[0] for line in warned) == sorted(
        ["FLYWHEEL_SERVICE_HOST", "FLYWHEEL_SERVICE_PORT", "FLYWHEEL_PORT", "FLYWHEEL_SERVE_SERVICE_HOST",
         "FLYWHEEL_SERVE_PORT", "FLYWHEEL_SERVE_PORT_8000_TCP_ADDR"])
    assert "sk-from-a-file" not in out.stdout + out.stderr and "pepper" not in out.stdout + out.stderr

    env["FLYWHEEL_API_KEYS"] = "sk-also-set"
    both = flywheel("config", "show", env=env, cwd=tmp_path)
    assert both.returncode == 2
    assert both.stderr.strip().splitlines()[-1] == (
        "flywheel: FLYWHEEL_API_KEYS and FLYWHEEL_API_KEYS_FILE are both set: set one, the value or the file "
        "that holds it")


def test_a_typo_in_the_config_file_is_an_error_through_the_command(tmp_path, env):
    (tmp_path / "flywheel.toml").write_text("[serve]\nprot = 9001\n")
    out = flywheel("config", "show", env=env, cwd=tmp_path)  # ./flywheel.toml
    assert out.returncode == 2 and "serve.prot: Extra inputs are not permitted" in out.stderr
