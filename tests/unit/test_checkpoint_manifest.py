"""Manifests: a clean directory verifies; any changed byte or extra weight file is refused."""

import pytest

from flywheel.checkpoints import manifest


def test_verify_and_tamper(tiny_model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    m = manifest.verify_dir(d)
    assert m["version"] == 0
    assert m["tensors"], "per-tensor hashes recorded"
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(manifest.ManifestError, match="model.safetensors hash mismatch"):
        manifest.verify_dir(d)


def test_announced_hash_must_match(tiny_model_dir):
    with pytest.raises(manifest.ManifestError, match="announced"):
        manifest.verify_dir(tiny_model_dir, expect_manifest_sha256="0" * 64)
    sha = manifest.sha256_file(tiny_model_dir / manifest.MANIFEST_NAME)
    assert manifest.verify_dir(tiny_model_dir, expect_manifest_sha256=sha)["version"] == 0


def test_missing_manifest_is_refused(tmp_path):
    with pytest.raises(manifest.ManifestError, match="refusing unverified"):
        manifest.verify_dir(tmp_path)
