"""Signed checkpoint and release records on a real broker: the trainer signs its announcements,
the release controller verifies them at its edge and signs its routings (flywheel/signing.py).

Anyone who may write ``flywheel.checkpoints`` could otherwise announce weights of their own, and
the controller would gate and canary them; the manifest hash only proves that the files match
the record. Here the records are written by the real trainer and controller code, or forged with
a plain producer the way such a writer would, and read back through the controller's own
Kafka side (release/streams.py). Serving's side is in test_serving_releases.py.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import make_trainer

from flywheel.contracts import CheckpointEvent, DeadLetterEvent, ReleaseEvent, decode, encode
from flywheel.kafka.clients import make_producer
from flywheel.kafka.producers import KafkaSink
from flywheel.metrics import new_registry
from flywheel.settings import ReleaseSettings, Settings
from flywheel.signing import Signer, Verifier, generate_key_pair
from local.broker import free_port
from release.store import Revision
from release.streams import Streams
from tests.conftest import read_all

pytestmark = pytest.mark.integration


@pytest.fixture
def keys(tmp_path) -> Path:
    """Key pairs ``trainer-1``, ``trainer-2`` (the trainer's, before and after a rotation),
    ``release-1`` (the controller's) and ``attacker``; ``trusted/`` holds trainer-1's public key."""
    for key_id in ("trainer-1", "trainer-2", "release-1", "attacker"):
        generate_key_pair(tmp_path / "pairs", key_id)
    (tmp_path / "trusted").mkdir()
    shutil.copy(tmp_path / "pairs" / "trainer-1.pub", tmp_path / "trusted")
    return tmp_path


def _streams(kafka_settings, topics, keys: Path, registry=None) -> Streams:
    release = ReleaseSettings(group_id=f"release-{topics.prefix}", signing_key=keys / "pairs" / "release-1.key",
                              trusted_checkpoint_keys=(keys / "trusted",))
    return Streams(Settings(kafka=kafka_settings, topic_prefix=topics.prefix, release=release),
                   registry if registry is not None else new_registry())


def _checkpoint(version: int) -> CheckpointEvent:
    return CheckpointEvent(version=version, parent=version - 1, step=version, uri=f"/elsewhere/v{version:08d}",
                           manifest_sha256="b" * 64, dtype="float32", full_snapshot=True, samples=8,
                           created_at=time.time())


def _send(kafka_settings, topic: str, value: bytes, headers: list | None = None) -> None:
    producer = make_producer(kafka_settings, "writer")
    producer.send(topic, key=b"k", value=value, headers=headers or []).get(timeout=10)
    producer.close()


def _read(streams: Streams, want: int, timeout_s: float = 60.0) -> list[dict]:
    """What the controller's edge makes of the checkpoints topic: ``want`` candidates, or all it
    gave within the timeout."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += streams.new_checkpoints()
        streams.commit_checkpoints()
    return got


def _deadletters(kafka_settings, topics, expect: int) -> list[DeadLetterEvent]:
    return [decode(DeadLetterEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=expect)]


def test_the_trainers_signed_announcement_is_a_candidate_and_forged_ones_are_dead_lettered(
        kafka_settings, topics, keys, tiny_model_dir, tmp_path):
    # the real trainer publishes v0 and announces it through its sink, signed with trainer-1
    sink = KafkaSink(lambda: make_producer(kafka_settings, "trainer"))
    tr = make_trainer(tiny_model_dir, tmp_path / "trainer", {"sink": sink}, topic_prefix=topics.prefix,
                      signing_key=keys / "pairs" / "trainer-1.key")
    tr.start()
    assert tr._settle_outputs(30.0)
    sink.close()
    # and three forgeries of v1: unsigned, signed by a key nobody trusts, and signed by that key
    # under the trusted key's name
    forged = encode(_checkpoint(1))
    _send(kafka_settings, topics.checkpoints, forged)
    _send(kafka_settings, topics.checkpoints, forged, Signer.load(keys / "pairs" / "attacker.key").headers(forged))
    impostor = keys / "impostor"
    generate_key_pair(impostor, "trainer-1")
    _send(kafka_settings, topics.checkpoints, forged, Signer.load(impostor / "trainer-1.key").headers(forged))

    streams = _streams(kafka_settings, topics, keys)
    try:
        got = _read(streams, 1)
        time.sleep(1.0)
        got += _read(streams, 0)  # anything the forgeries would have added
    finally:
        streams.close()
    assert [c["version"] for c in got] == [0]
    assert got[0]["uri"] == str(tr.store.path(0).resolve())
    letters = _deadletters(kafka_settings, topics, 3)
    assert sorted(dl.reason for dl in letters) == ["bad_signature", "unknown_key", "unsigned"]
    assert {dl.stage for dl in letters} == {"release"} and {dl.source_topic for dl in letters} == {topics.checkpoints}
    assert all(decode(CheckpointEvent, base64.b64decode(dl.value_b64)).version == 1 for dl in letters)


def test_rotation_of_the_trainers_key(kafka_settings, topics, keys):
    """Trust the new key beside the old, switch the signer, then remove the old key: records
    signed by either are candidates while both are trusted; afterwards the old key's are refused,
    with no restart of the controller."""
    old, new = Signer.load(keys / "pairs" / "trainer-1.key"), Signer.load(keys / "pairs" / "trainer-2.key")
    streams = _streams(kafka_settings, topics, keys)
    try:
        shutil.copy(keys / "pairs" / "trainer-2.pub", keys / "trusted")  # 1. the verifiers trust the new key
        for version, signer in ((1, old), (2, new)):  # 2. the signer switches
            value = encode(_checkpoint(version))
            _send(kafka_settings, topics.checkpoints, value, signer.headers(value))
        assert sorted(c["version"] for c in _read(streams, 2)) == [1, 2]
        (keys / "trusted" / "trainer-1.pub").unlink()  # 3. the old key goes
        for version, signer in ((3, old), (4, new)):
            value = encode(_checkpoint(version))
            _send(kafka_settings, topics.checkpoints, value, signer.headers(value))
        assert [c["version"] for c in _read(streams, 1)] == [4]
    finally:
        streams.close()
    [letter] = _deadletters(kafka_settings, topics, 1)
    assert letter.reason == "unknown_key" and "trainer-1" in letter.detail


def test_the_controller_signs_the_routings_it_publishes(kafka_settings, topics, keys):
    streams = _streams(kafka_settings, topics, keys)
    try:
        revision = Revision(revision=1, stable_version=0, canary_version=None, canary_share=0.0, reason="start",
                            at=time.time())
        assert streams.publish([revision], "flywheel", lambda v: None) == [1]
    finally:
        streams.close()
    [rec] = read_all(kafka_settings.bootstrap, topics.releases, expect=1)
    serving_side = Verifier.load([keys / "pairs" / "release-1.pub"], setting="serve.trusted_release_keys")
    assert serving_side.check(rec.value, rec.headers) == "release-1"
    assert decode(ReleaseEvent, rec.value).revision == 1


def test_a_serving_whose_trusted_keys_cannot_be_read_stops_before_it_loads_an_engine(tiny_model_dir, tmp_path):
    """A typo in the key path is found in seconds, not after the engines load (minutes on a GPU)
    and again on every restart of a crash loop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_MODEL_DIR=str(tiny_model_dir), FLYWHEEL_DATA_DIR=str(tmp_path),
               FLYWHEEL_KAFKA_BOOTSTRAP=f"127.0.0.1:{free_port()}", FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS="500",
               FLYWHEEL_SERVE_TRUSTED_RELEASE_KEYS=str(tmp_path / "no-such-dir"))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cli", "serve"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "serve.trusted_release_keys" in out.stderr and "no-such-dir" in out.stderr
    assert "EngineCore" not in out.stderr and "Initializing" not in out.stderr  # no engine was started
    assert time.monotonic() - t0 < 60


def test_the_controller_shows_what_it_verifies_and_signs_with(kafka_settings, topics, keys):
    """What ``/api/status`` (``controller.signing``), the console and ``/metrics`` show of the
    controller's keys: a malformed ``.pub`` beside the trainer's (refused, the trainer's key still
    trusted, where a restart once stopped on it), and a controller with no keys at all."""
    (keys / "trusted" / "trainer-2.pub").write_bytes(b"")  # a rotation's file, not written yet
    registry = new_registry()
    streams = _streams(kafka_settings, topics, keys, registry)
    try:
        signing = streams.signing()
        assert signing["releases_signed_with"] == "release-1"
        assert signing["checkpoints"]["verified"] and signing["checkpoints"]["trusted_key_ids"] == ["trainer-1"]
        assert [f["path"] for f in signing["checkpoints"]["refused_key_files"]] == [str(keys / "trusted" / "trainer-2.pub")]
        got = {name: registry.get_sample_value(f"release_checkpoint_{name}")
               for name in ("signatures_verified", "trusted_keys", "key_files_refused")}
        assert got == {"signatures_verified": 1, "trusted_keys": 1, "key_files_refused": 1}
        signer = Signer.load(keys / "pairs" / "trainer-1.key")
        value = encode(_checkpoint(1))
        _send(kafka_settings, topics.checkpoints, value, signer.headers(value))
        assert [c["version"] for c in _read(streams, 1)] == [1]  # still verifying on the key it has
    finally:
        streams.close()
    registry = new_registry()
    bare = Settings(kafka=kafka_settings, topic_prefix=topics.prefix,
                    release=ReleaseSettings(group_id=f"release-bare-{topics.prefix}"))
    streams = Streams(bare, registry)
    try:
        assert streams.signing() == {"checkpoints": {"verified": False, "trusted_key_ids": [], "refused_key_files": []},
                                     "releases_signed_with": None}
        assert registry.get_sample_value("release_checkpoint_signatures_verified") == 0
    finally:
        streams.close()
