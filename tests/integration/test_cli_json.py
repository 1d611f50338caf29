"""``-o json`` on the listing commands (``deadletters``, ``status``, ``topics``, ``checkpoint list``): one
JSON object on one line of stdout, parsed here, in the shape flywheel/output.py and the README
promise. Against the session's real broker and a real ``flywheel up`` supervisor with a child;
the release commands' JSON is tested in test_release_ops.py, ``usage``'s in test_serving_usage.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from conftest import stage_env

from cli.main import main
from flywheel.checkpoints import MANIFEST_NAME, WEIGHTS, CheckpointStore, manifest
from flywheel.contracts import DeadLetterEvent, Topics, encode
from flywheel.kafka.clients import make_producer
from local.up import Child, Supervisor, status_path

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def one_object(out: str) -> dict:
    """stdout must be exactly one line holding one JSON object (never a bare list)."""
    assert out.endswith("\n") and out.count("\n") == 1, out
    body = json.loads(out)
    assert isinstance(body, dict)
    return body


def _letter(topics: Topics, reason: str, offset: int, t: float, detail: str = "") -> DeadLetterEvent:
    return DeadLetterEvent(stage="ingest", reason=reason, detail=detail, source_topic=topics.feedback,
                           source_partition=0, source_offset=offset, key_b64=base64.b64encode(b"k").decode(),
                           value_b64=base64.b64encode(b'{"x": %d}' % offset).decode(), failed_at=t)


def test_deadletters_summary_show_and_replay_print_one_json_object(kafka_settings, topics, tmp_path, monkeypatch,
                                                                   capsys):
    t = time.time()
    forged = "bad\n\x1b[31m\u202e"  # text a terminal would act on: JSON escapes it
    with closing(make_producer(kafka_settings, "test")) as producer:
        for i, reason in enumerate(["orphan_feedback", "orphan_feedback", "invalid"]):
            producer.send(topics.deadletter, key=b"k", value=encode(_letter(topics, reason, i, t + i, forged)))
        producer.send(topics.deadletter, key=b"k", value=b"{not a letter")
        producer.flush()
    env = stage_env(kafka_settings, topics, tmp_path)

    # the real command, as a script runs it: its exit code and stdout alone
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    done = subprocess.run([sys.executable, "-m", "cli", "deadletters", "summary", "-o", "json"], cwd=ROOT,
                          env=clean | env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    body = one_object(done.stdout)
    assert (body["topic"], body["dead_letters"], body["selected"], body["unreadable"]) == (topics.deadletter, 3, 3, 1)
    rows = {(r["stage"], r["reason"], r["source_topic"]): r for r in body["summary"]["rows"]}
    assert {k: r["count"] for k, r in rows.items()} == {("ingest", "orphan_feedback", topics.feedback): 2,
                                                       ("ingest", "invalid", topics.feedback): 1}
    orphans = rows[("ingest", "orphan_feedback", topics.feedback)]
    assert (orphans["first_failed_at"], orphans["last_failed_at"]) == pytest.approx((t, t + 1))
    assert body["summary"]["repeats"] == 0

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["deadletters", "show", "--reason", "orphan_feedback", "--limit", "1", "-o", "json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out  # escaped in the JSON text, whole once decoded
    (letter,) = one_object(out)["show"]["letters"]
    assert letter["detail"] == forged and base64.b64decode(letter["value_b64"]) == b'{"x": 0}'
    assert (letter["reason"], letter["source_topic"], letter["source_offset"]) == ("orphan_feedback",
                                                                                   topics.feedback, 0)

    assert main(["deadletters", "replay", "--dry-run", "-o", "json"]) == 0
    replay = one_object(capsys.readouterr().out)["replay"]
    assert replay["dry_run"] is True and replay["sent_total"] == 3
    assert sorted((s["reason"], s["count"]) for s in replay["sent"]) == [("invalid", 1), ("orphan_feedback", 2)]
    assert replay["refused"] == [] and replay["before"] == 0


def test_topics_lists_the_deployments_topics_as_json(kafka_settings, topics, tmp_path, monkeypatch, capsys):
    for key, value in stage_env(kafka_settings, topics, tmp_path).items():
        monkeypatch.setenv(key, value)
    assert main(["topics", "-o", "json"]) == 0
    body = one_object(capsys.readouterr().out)
    assert body["topics"] == list(topics.all()) and body["drifted"] == 0
    # each topic's check beside the names (tests/integration/test_topics.py: drift)
    assert [(c["name"], c["found"]) for c in body["checks"]] == [(t, "as_declared") for t in topics.all()]


#: A child that runs until SIGTERM.
IDLE = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\nwhile True: time.sleep(0.05)\n"


def test_status_prints_what_flywheel_up_runs_as_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))
    assert main(["status", "-o", "json"]) == 1  # nothing runs here yet
    assert one_object(capsys.readouterr().out) == {"running": False, "status_file": str(status_path(tmp_path))}

    child = Child("ingest", [sys.executable, "-c", IDLE], dict(os.environ), tmp_path / "logs" / "ingest.log")
    sup = Supervisor([child], status_path(tmp_path), say=lambda _: None)
    runner = threading.Thread(target=sup.run, kwargs={"poll_s": 0.05}, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not status_path(tmp_path).exists() or child.proc is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert main(["status", "-o", "json"]) == 0
        body = one_object(capsys.readouterr().out)
        assert (body["running"], body["pid"], body["broker"]) == (True, os.getpid(), None)
        assert body["age_s"] >= 0 and body["status_file"] == str(status_path(tmp_path))
        (stage,) = body["stages"]
        assert (stage["name"], stage["state"], stage["pid"], stage["restarts"]) == ("ingest", "running",
                                                                                   child.proc.pid, 0)
    finally:
        sup.request_stop()
        runner.join(30)
    assert main(["status", "-o", "json"]) == 1
    body = one_object(capsys.readouterr().out)
    assert body["running"] is False and [s["state"] for s in body["stages"]] == ["stopped"]


def test_checkpoint_list_shows_every_version_from_its_manifest(tiny_model_dir, tmp_path, monkeypatch, capsys):
    store = CheckpointStore(tmp_path / "store", full_every=10, keep_full=1)
    weights = bytearray((tiny_model_dir / WEIGHTS).read_bytes())
    for version in range(3):
        tmp = store.staging_dir(version)
        if version:
            weights[-4096 * version] ^= 0x01
        (tmp / WEIGHTS).write_bytes(bytes(weights))
        store.commit(tmp, version=version, parent=version - 1 if version else None, source_dir=tiny_model_dir,
                     extra={"step": 10 * version, "samples": 4}, ledger={})
    monkeypatch.setenv("FLYWHEEL_TRAINER_STORE", str(store.root))
    assert main(["checkpoint", "list", "-o", "json"]) == 0
    body = one_object(capsys.readouterr().out)
    assert body["store"] == str(store.root)
    assert [(r["version"], r["parent"], r["step"], r["kind"], r["snapshot"], r["weights"]) for r in body["versions"]] == [
        (0, None, 0, "full", True, "file"), (1, 0, 10, "full", False, "delta"), (2, 1, 20, "full", False, "file")]
    assert body["versions"][1]["manifest_sha256"] == manifest.sha256_file(store.path(1) / MANIFEST_NAME)
    assert all(r["created_at"] > 0 and r["samples"] == 4 and r["base"] is None for r in body["versions"])

    assert main(["checkpoint", "list"]) == 0  # the table a person reads
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["VERSION", "PARENT", "STEP", "SAMPLES", "KIND", "WEIGHTS", "CREATED"]
    assert [r.split()[:6] for r in rows][1] == ["1", "0", "10", "4", "full", "delta"]
