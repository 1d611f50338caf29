"""Manifests: a clean directory verifies; any changed byte or extra weight file is refused."""

import re

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


def _copy(tiny_model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    return d


@pytest.mark.parametrize("name", ["modeling_extra.py", "optimizer.pkl", "pytorch_model.bin", ".hidden", "model.safetensors.index.json"])
def test_an_unlisted_file_is_refused_and_named(tiny_model_dir, tmp_path, name):
    """A loader reads more than weights (remote code, pickles, a chat template): what no hash covers
    must not sit in a verified directory."""
    d = _copy(tiny_model_dir, tmp_path)
    (d / name).write_text("import os  # planted\n")
    with pytest.raises(manifest.ManifestError, match=re.escape(f"not in the manifest: ['{name}']")):
        manifest.verify_dir(d)


def test_an_unlisted_directory_is_refused_unless_the_caller_allows_it(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    (d / "ds").mkdir()
    (d / "ds" / "state.pt").write_bytes(b"\x80\x04planted")
    with pytest.raises(manifest.ManifestError, match=r"not in the manifest: \['ds'\]"):
        manifest.verify_dir(d)
    assert manifest.verify_dir(d, allow_dirs={"ds"})["version"] == 0
    (d / "ds2").write_text("a file, not a directory")
    with pytest.raises(manifest.ManifestError, match=r"not in the manifest: \['ds2'\]"):
        manifest.verify_dir(d, allow_dirs={"ds", "ds2"})


def test_a_file_the_manifest_lists_is_accepted(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    (d / "modeling_extra.py").write_text("# a file the manifest lists is verified like any other")
    manifest.write(d, manifest.build(d, version=0, parent=None))
    assert "modeling_extra.py" in manifest.verify_dir(d)["files"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_tampered_listed_file_that_is_not_weights_is_refused(tiny_model_dir, tmp_path, name):
    d = _copy(tiny_model_dir, tmp_path)
    assert name in manifest.read(d)["files"], "init_model's manifest lists every file it wrote"
    path = d / name
    path.write_bytes(path.read_bytes().replace(b"}", b', "auto_map": {}}', 1))
    with pytest.raises(manifest.ManifestError, match=re.escape(f"{name} hash mismatch")):
        manifest.verify_dir(d)
