"""Checkpoints on an object store: the real store code against a local S3 API (moto's server mode
on loopback, the session's ``s3_endpoint``), reached through the standard AWS variables.

The trainer's part (a real DeepSpeed trainer publishing to ``s3://``, restarted on a fresh disk,
resuming with its optimizer state) and the controller's and serving's reads with no shared
directory are in tests/integration/test_object_store_slow.py.
"""

from __future__ import annotations

import errno
import shutil
import struct
from pathlib import Path

import pytest

from flywheel.checkpoints import CheckpointStore, ManifestError, ObjectStore, manifest
from flywheel.checkpoints.fetch import VersionRefused, fetch_version
from release.controller import verified_dir


def _weights(model_dir: Path, bump: int) -> bytes:
    """The tiny model's weights with ``bump`` added to a few bytes of the data section: a new
    version that a delta from the last holds in little."""
    raw = bytearray((model_dir / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for i in range(8 + n + 64, len(raw), 4096):
        raw[i] = (raw[i] + bump) % 256
    return bytes(raw)


def _publish_chain(model_dir: Path, root: Path, n: int) -> CheckpointStore:
    """Versions 0..n-1 of the tiny model in a local store, each but the first a delta, each with
    a ``ds/`` optimizer state, as the trainer's rank 0 commits them."""
    store = CheckpointStore(root, full_every=100, keep_full=1, keep_optimizer=1)
    for v in range(n):
        tmp = store.staging_dir(v)
        (tmp / "model.safetensors").write_bytes(_weights(model_dir, v))
        (tmp / "ds" / "global_step").mkdir(parents=True)
        (tmp / "ds" / "global_step" / "optim_states.pt").write_bytes(b"adam moments of v%d" % v)
        store.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=model_dir, extra={"step": v},
                     ledger={"trained": [f"gen-{v}"], "dropped": {}})
    return store


def test_a_version_published_to_s3_is_fetched_verified_and_a_tampered_one_refused(tiny_model_dir, s3_url, tmp_path):
    local = _publish_chain(tiny_model_dir, tmp_path / "trainer", 3)
    remote = ObjectStore(s3_url)
    assert remote.versions() == []
    for v in local.versions():
        assert remote.publish(local.path(v)) == f"{s3_url}/v{v:08d}"
    remote.prune(keep_full=1, keep_optimizer=1)
    # a publish cut short before its manifest: files, no manifest, so no version
    remote.fs.pipe_file(f"{remote.base}/v00000003/model.safetensors", b"half")
    assert remote.versions() == [0, 1, 2]
    assert remote.ledger(1) == {"trained": ["gen-1"], "dropped": {}}
    assert not remote.fs.exists(f"{remote.base}/v00000001/model.safetensors")  # pruned to its delta
    assert not remote.fs.exists(f"{remote.base}/v00000001/ds") and remote.fs.exists(f"{remote.base}/v00000002/ds")

    # a reader with its own cache and nothing shared: v1 is rebuilt from v0 and its delta
    cache = CheckpointStore(tmp_path / "reader")
    sha = manifest.sha256_file(local.path(1) / manifest.MANIFEST_NAME)
    got = fetch_version(remote.uri(1), 1, sha, cache)
    assert (got.path / "model.safetensors").read_bytes() == _weights(tiny_model_dir, 1)
    assert not (got.path / "ds").exists()  # the optimizer state is the trainer's alone
    # the release controller's gate reads the announced URL the same way, into a cache of its own
    gate_dir = verified_dir(CheckpointStore(tmp_path / "controller"), 2, manifest.sha256_file(
        local.path(2) / manifest.MANIFEST_NAME), tmp_path / "gate" / "candidate", remote.uri(2))
    assert (gate_dir / "model.safetensors").read_bytes() == _weights(tiny_model_dir, 2)

    # a version's object rewritten in the store: refused, nothing of it left in the cache
    remote.fs.pipe_file(f"{remote.base}/v00000002/model.safetensors", _weights(tiny_model_dir, 7))
    with pytest.raises(VersionRefused) as refused:
        fetch_version(remote.uri(2), 2, manifest.sha256_file(local.path(2) / manifest.MANIFEST_NAME), cache)
    assert refused.value.reason == "verification_failed" and not cache.path(2).exists()
    # a manifest other than the announced one: refused before a byte of weights is copied
    with pytest.raises(VersionRefused) as refused:
        fetch_version(remote.uri(1), 1, "0" * 64, CheckpointStore(tmp_path / "other"))
    assert refused.value.reason == "manifest_mismatch"

    # a version number never gets a second content
    other = _publish_chain(tiny_model_dir, tmp_path / "another-trainer", 1)
    (other.path(0) / "ledger.json").write_text('{"trained": [], "dropped": {}}')
    manifest.write(other.path(0), manifest.build(other.path(0), version=0, parent=None, extra={"full_snapshot": True}))
    with pytest.raises(ManifestError, match="another manifest"):
        remote.publish(other.path(0))


def test_a_trainer_on_a_fresh_disk_pulls_the_newest_version_with_its_optimizer_state(tiny_model_dir, s3_url, tmp_path):
    local = _publish_chain(tiny_model_dir, tmp_path / "trainer", 2)
    remote = ObjectStore(s3_url)
    for v in local.versions():
        remote.publish(local.path(v))
    remote.mark_announced(1)
    shutil.rmtree(local.root)  # the pod is replaced: its emptyDir is gone

    fresh = CheckpointStore(tmp_path / "new-pod")
    path = remote.pull(remote.latest(), fresh)
    assert fresh.versions() == [1] and path == fresh.path(1)
    assert (path / "ds" / "global_step" / "optim_states.pt").read_bytes() == b"adam moments of v1"
    assert (path / "model.safetensors").read_bytes() == _weights(tiny_model_dir, 1)
    manifest.verify_dir(path, allow_dirs={"ds"})
    assert remote.announced() == 1


def test_an_object_store_that_does_not_answer_is_out_of_reach_and_a_broken_one_is_not(tmp_path):
    """The trainer waits out a store that is away (trainer/outage.py asks ``out_of_reach``) and
    fails on a broken one. An S3 client's errors are its own classes, not an OSError with an
    errno: the old store judged them by listing its local root, which answers, so a trainer
    stopped on an endpoint that did not answer. The errors are the clients' real classes, as
    s3fs raises them after its retries (a dead endpoint takes it about 10 s to give up)."""
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    store = CheckpointStore(tmp_path / "trainer")
    store.remote = ObjectStore("memory://bucket/checkpoints")
    try:
        raise OSError("upload failed") from EndpointConnectionError(endpoint_url="http://minio:9000/bucket")
    except OSError as wrapped:
        err = store.out_of_reach(wrapped)
    assert err is not None and err.errno == errno.EHOSTUNREACH and "minio:9000" in str(err)
    assert store.out_of_reach(NoCredentialsError()).errno == errno.EACCES
    assert store.out_of_reach(PermissionError("Access Denied")).errno == errno.EACCES
    assert store.out_of_reach(ManifestError("a hash that does not match")) is None
    assert store.out_of_reach(FileNotFoundError("v00000003/delta.fwd")) is None


@pytest.mark.slow  # 5-10 s (a trainer publish, then each command fetches and verifies); test_object_store's
# short run keeps the store itself in the default suite
def test_checkpoint_list_and_verify_read_the_object_store_the_settings_name(tiny_model_dir, s3_url, tmp_path,
                                                                             monkeypatch, capsys):
    """``flywheel checkpoint list`` and ``verify`` with ``trainer.store`` an ``s3://`` URL read that
    store. They read the local store under ``<data_dir>/checkpoints`` instead: the trainer's
    working copy where it runs, nothing at all anywhere else ('no versions'). ``verify`` fetches
    the version (v1 rebuilt from v0 and its delta) into a temporary cache it leaves nothing of."""
    import json

    from cli.main import main

    local = _publish_chain(tiny_model_dir, tmp_path / "trainer", 3)
    remote = ObjectStore(s3_url)
    for v in local.versions():
        remote.publish(local.path(v))
    remote.prune(keep_full=1, keep_optimizer=1)
    monkeypatch.setenv("FLYWHEEL_TRAINER_STORE", s3_url)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "reader"))

    assert main(["checkpoint", "list", "-o", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["store"] == s3_url
    assert [(r["version"], r["parent"], r["weights"]) for r in body["versions"]] == [
        (0, None, "file"), (1, 0, "delta"), (2, 1, "file")]
    assert body["versions"][1]["manifest_sha256"] == manifest.sha256_file(local.path(1) / manifest.MANIFEST_NAME)
    assert main(["checkpoint", "verify", "1"]) == 0
    assert capsys.readouterr().out.startswith("version 1: OK")

    remote.fs.pipe_file(f"{remote.base}/v00000002/model.safetensors", _weights(tiny_model_dir, 7))
    assert main(["checkpoint", "verify"]) == 1  # the latest, 2, whose object was rewritten
    assert "version 2: FAILED" in capsys.readouterr().err
    assert list((tmp_path / "reader" / "checkpoints").iterdir()) == []
