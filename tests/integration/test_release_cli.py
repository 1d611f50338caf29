"""``flywheel release ...`` against a live API on loopback (release/api.py on uvicorn), over a real
SQLite file and a real PostgreSQL schema. Most commands run in this process through
``cli.main.main`` (the same code path as the console script, without a second interpreter start);
one runs as ``python -m cli`` to check the process's exit code and streams for real.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import test_release_api as shared
from test_release_api import TOKENS, seed

from cli.main import main
from flywheel.settings import Settings
from release.client import EXIT_AUTH
from release.states import State

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# The API module's fixtures, shared by assignment: pytest finds fixtures among a module's names.
release_db_url = shared.release_db_url
store = shared.store
api = shared.api


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["release", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def columns(table: str) -> list[list[str]]:
    return [line.split() for line in table.strip().splitlines()]


def test_list_and_show_print_aligned_tables_of_versions_and_states(api, store, capsys):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.SUPERSEDED, parent=1)
    seed(store, 10, State.AWAITING_APPROVAL, parent=1)
    store.save(10, gate={"outcome": "pass", "reasons": ["24 held-out prompts: every check within its limit"],
                         "kl_from_stable": 0.02},
               analysis={"outcome": "running", "reasons": ["stable has 12 of the 50 outcomes needed"],
                         "e_better": 1.7, "band": [[1, 0.1, 0.9]]})
    a = api()
    code, out, err = run(capsys, "list", "--url", a.url, "--token", TOKENS["vera"])
    assert (code, err) == (0, "")
    lines = out.strip().splitlines()
    assert lines[0].split() == ["VERSION", "PARENT", "STEP", "STATE", "GATE", "CANARY", "UPDATED"]
    rows = columns(out)[1:]
    assert [(r[0], r[1], r[3], r[4], r[5]) for r in rows] == [
        ("1", "-", "promoted", "-", "-"), ("2", "1", "superseded", "-", "-"),
        ("10", "1", "awaiting_approval", "pass", "running")]
    state_at = lines[0].index("STATE")  # aligned: every row's state starts under its header
    assert all(line[state_at:].split()[0] == row[3] for line, row in zip(lines[1:], rows, strict=True))

    code, out, err = run(capsys, "show", "10", "--url", a.url, "--token", TOKENS["vera"])
    assert code == 0, err
    fields = dict(line.split(None, 1) for line in out.split("\n\n")[0].splitlines()[1:])
    assert fields["state"] == "awaiting_approval" and fields["manifest"] == f"{10:064x}"
    assert "gate: pass\n  - 24 held-out prompts: every check within its limit" in out
    measures = {r[0]: r[1] for r in columns(out) if len(r) == 2}
    assert measures["kl_from_stable"] == "0.02" and measures["e_better"] == "1.7"
    assert "band" not in measures  # a history is for the console's chart, not a terminal
    assert "canary analysis: running" in out
    audit = out.split("audit (newest first):\n")[1]
    assert [r[4:7] for r in columns(audit)[1:]] == [["canary", "->", "awaiting_approval"],
                                                   ["gating", "->", "canary"], ["candidate", "->", "gating"],
                                                   ["new", "->", "candidate"]]


def test_approve_promotes_and_the_audit_names_the_approver(api, store, capsys):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.AWAITING_APPROVAL, parent=1)
    a = api()
    code, out, err = run(capsys, "approve", "2", "--reason", "accept rate up 4 points",
                         "--url", a.url, "--token", TOKENS["abe"])
    assert (code, err) == (0, "")
    rev = store.latest_revision()
    assert out.strip() == f"promoted v2 (revision {rev.revision}: stable v2)"
    assert store.get(2).state == State.PROMOTED and store.stable_version() == 2
    code, out, _ = run(capsys, "audit", "--version", "2", "--limit", "1", "--url", a.url, "--token", TOKENS["vera"])
    assert code == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["WHEN", "ACTOR", "VERSION", "CHANGE", "REASON"]
    assert row.split()[2:] == ["abe", "2", "awaiting_approval", "->", "promoted", "accept", "rate", "up", "4", "points"]

    code, _, err = run(capsys, "approve", "2", "--url", a.url, "--token", TOKENS["abe"])  # a refusal: 409
    assert code == 1 and err.startswith("error: version 2 is promoted")


def test_wrong_token_exits_77_not_the_usage_errors_2(api, store):
    # a script must tell "fix the command" (2, argparse's) from "fix the token or ask for a
    # role" (77, EX_NOPERM) without reading stderr: both exited 2
    seed(store, 1, State.AWAITING_APPROVAL)
    a = api()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    done = subprocess.run([sys.executable, "-m", "cli", "release", "list", "--url", a.url, "--token", "wrong"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (EXIT_AUTH, "", "error: invalid token\n")
    assert EXIT_AUTH == 77


def test_too_low_a_role_or_no_token_exits_77_and_other_failures_exit_1(api, store, capsys, monkeypatch):
    seed(store, 1, State.AWAITING_APPROVAL)
    a = api()
    code, out, err = run(capsys, "approve", "1", "--url", a.url, "--token", TOKENS["vera"])
    assert (code, out) == (77, "")
    assert err == "error: this needs the approver role; vera is a viewer\n"
    assert store.get(1).state == State.AWAITING_APPROVAL
    monkeypatch.delenv("FLYWHEEL_RELEASE_TOKEN", raising=False)
    monkeypatch.delenv("FLYWHEEL_RELEASE_TOKEN_FILE", raising=False)
    code, _, err = run(capsys, "list", "--url", a.url)
    assert code == 77 and "pass --token-file or --token, or set FLYWHEEL_RELEASE_TOKEN_FILE" in err
    code, _, err = run(capsys, "reject", "99", "--url", a.url, "--token", TOKENS["abe"])
    assert code == 1 and err == "error: no version 99 was ever published to this controller\n"
    code, _, err = run(capsys, "pause", "--reason", "x" * 2001, "--url", a.url, "--token", TOKENS["ada"])
    assert code == 1 and err.startswith("error: reason: String should have at most 2000 characters")
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9", "--token", "t")  # nothing listens there
    assert code == 1 and err.startswith("error: cannot reach the release controller at http://127.0.0.1:9")


def test_url_and_token_default_to_the_settings_and_the_environment(api, store, capsys, monkeypatch):
    a = api()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("FLYWHEEL_RELEASE_PORT", a.url.rsplit(":", 1)[1])
    monkeypatch.setenv("FLYWHEEL_RELEASE_TOKEN", TOKENS["ada"])  # the CLI's own variable, not a setting
    code, out, err = run(capsys, "pause", "--reason", "rebalancing the cluster")
    assert (code, out.strip(), err) == (0, "pipeline paused", "")
    assert store.paused() and store.audit(limit=1)[0].actor == "ada"
    code, out, _ = run(capsys, "pause", "--reason", "again")
    assert out.strip() == "pipeline was already paused: nothing changed"
    code, out, _ = run(capsys, "status")
    assert code == 0
    status = {r[0]: r[1:] for r in columns(out)}
    assert status["pipeline"] == ["PAUSED"] and status["stable"] == ["v0"] and status["canary"] == ["none"]


def test_status_says_who_the_live_canary_left_out_and_its_pass_level(api, store, capsys):
    seed(store, 4, State.CANARY)
    store.save(4, analysis={"outcome": "running", "reasons": [], "excluded_users": 3, "pass_alpha": 0.025})
    code, out, err = run(capsys, "status", "--url", api().url, "--token", TOKENS["vera"])
    assert code == 0, err
    line = next(r for r in out.splitlines() if r.split()[0] == "canary")
    assert line.split(None, 1)[1] == ("v4 (10% of users; 3 users flagged by reward's guards left out; "
                                      "PASS at level 0.025)")


def test_serve_hands_the_settings_to_release_main(monkeypatch):
    # release/main.py (the controller loop and this API) is its own module; the command only
    # parses settings and calls its run(settings, args), imported when the command runs
    calls = []
    fake = types.ModuleType("release.main")
    fake.run = lambda settings, args: calls.append((settings, args)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "release.main", fake)
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "WARNING")
    assert main(["release", "serve"]) == 7
    (settings, args), = calls
    assert isinstance(settings, Settings) and args.release_cmd == "serve"


def test_pause_and_resume_need_a_reason_before_anything_is_sent(capsys):
    for command in ("pause", "resume"):
        with pytest.raises(SystemExit) as exit_:
            main(["release", command, "--url", "http://127.0.0.1:9"])
        assert exit_.value.code == 2
        assert "--reason" in capsys.readouterr().err


#: What the CLI must never print raw (tests/integration/test_release_api.py: FORGING_REASONS).
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def test_stored_text_that_could_forge_the_output_is_printed_escaped(api, store):
    # rows already in a database (written before the API refused such reasons, or by hand) must
    # not forge a row, move the cursor or reorder the text of the terminal that shows them
    seed(store, 1, State.AWAITING_APPROVAL)
    forged = "ok\n2026-01-01 00:00:00Z  alice  1  held -> promoted  approved\x1b[31m\x9b2J\u202eevil\u2028x"
    store.note(1, "mallory\x1b]0;title\x07", forged)
    a = api()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    for command in (["audit"], ["show", "1"]):
        done = subprocess.run([sys.executable, "-m", "cli", "release", *command, "--url", a.url,
                               "--token", TOKENS["vera"]], cwd=ROOT, env=env, capture_output=True, timeout=60,
                              check=False)
        out = done.stdout.decode("utf-8")
        assert done.returncode == 0, done.stderr
        assert not RAW.search(out), [m.group() for m in RAW.finditer(out)]
        row = next(line for line in out.splitlines() if "mallory" in line)
        assert "ok\\n2026-01-01" in row and "\\x1b[31m\\x9b2J\\u202eevil\\u2028x" in row, row
        assert "mallory\\x1b]0;title\\x07" in row
        assert not any(line.lstrip().startswith("2026-01-01 00:00:00Z  alice") for line in out.splitlines())


@pytest.mark.parametrize("reason", ["two\nlines", "c1 \x9b2J", "bidi \u202e", "sep\u2029"])
def test_a_reason_that_could_forge_the_audit_log_is_a_usage_error_before_anything_is_sent(capsys, reason):
    for command in (["reject", "1"], ["pause"]):
        with pytest.raises(SystemExit) as exit_:
            main(["release", *command, "--reason", reason, "--url", "http://127.0.0.1:9", "--token", "t"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--reason" in err and "one line of text" in err and "U+" in err, err


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m cli release ...`` as a process, without the test run's FLYWHEEL_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return subprocess.run([sys.executable, "-m", "cli", "release", *argv], cwd=ROOT, env=clean | (env or {}),
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_token_comes_from_a_file_named_by_flag_or_variable_newline_dropped(api, store, tmp_path):
    # --token puts the token in every user's `ps`; a file (a mounted Secret, `pass show > f`) does not
    seed(store, 1, State.AWAITING_APPROVAL)
    a = api()
    token = tmp_path / "token"
    token.write_text(TOKENS["ada"] + "\n")  # `echo token > file` ends it with a newline
    done = _cli("pause", "--reason", "freeze", "--url", a.url, "--token-file", str(token))
    assert (done.returncode, done.stdout, done.stderr) == (0, "pipeline paused\n", "")
    assert store.audit(limit=1)[0].actor == "ada"  # the file's token, not a 401 for "token\n"
    done = _cli("resume", "--reason", "thaw", "--url", a.url, env={"FLYWHEEL_RELEASE_TOKEN_FILE": str(token)})
    assert (done.returncode, done.stdout, done.stderr) == (0, "pipeline running\n", "")
    assert "not a setting" not in done.stderr  # the CLI's own variable, not warned about as a misspelt setting


@pytest.mark.parametrize("problem", ["missing", "empty", "directory", "both variables", "both flags"])
def test_a_token_file_that_cannot_be_used_is_a_usage_error_naming_it_and_nothing_is_sent(
        api, store, tmp_path, capsys, monkeypatch, problem):
    seed(store, 1, State.AWAITING_APPROVAL)
    a = api()
    secret = "s3cret-" + TOKENS["ada"]
    path = tmp_path / "token"
    argv = ["--token-file", str(path)]
    for name in ("FLYWHEEL_RELEASE_TOKEN", "FLYWHEEL_RELEASE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    if problem == "empty":
        path.write_text("\n")
    elif problem == "directory":
        path.mkdir()
    elif problem == "both variables":
        path.write_text(secret)
        argv = []
        monkeypatch.setenv("FLYWHEEL_RELEASE_TOKEN_FILE", str(path))
        monkeypatch.setenv("FLYWHEEL_RELEASE_TOKEN", secret)
    elif problem == "both flags":
        argv = [*argv, "--token", secret]
    try:  # in this process: the exit code is main's, or argparse's SystemExit (the file-read test runs a process)
        code = main(["release", "pause", "--reason", "freeze", "--url", a.url, *argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert secret not in err and "Traceback" not in err
    if problem == "both flags":
        assert "not allowed with argument" in err  # argparse's own usage error
    elif problem == "both variables":
        assert "FLYWHEEL_RELEASE_TOKEN and FLYWHEEL_RELEASE_TOKEN_FILE are both set" in err
    else:
        assert str(path) in err and err.startswith("flywheel: --token-file: "), err
    assert not store.paused()  # nothing reached the API
