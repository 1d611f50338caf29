"""Sharded weights through the checkpoint format: manifests, the store, the delta chain and fetch.

An imported model keeps its shards (each a file of its manifest); the store publishes every
version as one consolidated ``model.safetensors`` (flywheel/checkpoints/store.py says why). These
tests hold both halves: a sharded directory is hashed and verified shard by shard, fetched whole
or refused with a reason; a store fed from it never carries a shard or the index beside its
consolidated weights, and its delta chain from the tied model's consolidated weights is bit-exact.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_helpers import shards

from flywheel.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    ManifestError,
    manifest,
    verify_dir,
    vname,
)
from flywheel.checkpoints.fetch import VersionRefused, fetch_version
from flywheel.hfimport import import_hf_dir


@pytest.fixture(scope="module")
def imported(sharded_hf_dir, tmp_path_factory) -> Path:
    """A sharded, tied model directory as ``flywheel model import`` writes it (version 0)."""
    out = tmp_path_factory.mktemp("sharded") / "model"
    import_hf_dir(sharded_hf_dir, out)
    return out


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def consolidated(model_dir: Path) -> dict[str, torch.Tensor]:
    """The shards' tensors in one dict: what the trainer's publish writes for the same model."""
    return {k: v for s in shards(model_dir) for k, v in load_file(str(s)).items()}


# -- manifests -------------------------------------------------------------------------------------
def test_every_shard_is_verified_before_serving(imported, tmp_path):
    d = Path(shutil.copytree(imported, tmp_path / "m"))
    verify_dir(d)
    victim = shards(d)[3]
    _flip_last_byte(victim)
    with pytest.raises(ManifestError, match=rf"{victim.name} hash mismatch"):
        verify_dir(d)
    victim.unlink()
    with pytest.raises(ManifestError, match=rf"file {victim.name} listed in the manifest is missing"):
        verify_dir(d)


def test_a_tensor_in_two_shards_cannot_get_a_manifest(imported, tmp_path):
    d = Path(shutil.copytree(imported, tmp_path / "m"))
    first, second = shards(d)[:2]
    save_file({**load_file(str(second)), **dict(list(load_file(str(first)).items())[:1])}, str(second))
    with pytest.raises(ManifestError, match="is in both"):
        manifest.build(d, version=0, parent=None)


# -- the store: consolidated versions from a sharded model ----------------------------------------
@pytest.fixture(scope="module")
def store(imported, tmp_path_factory) -> tuple[CheckpointStore, dict[int, str]]:
    """v0 the sharded model's weights in one file, v1 and v2 moved (v1 pruned to its delta), as the
    trainer publishes them with ``source_dir`` the imported model."""
    st = CheckpointStore(tmp_path_factory.mktemp("store") / "checkpoints", full_every=10, keep_full=1)
    weights = consolidated(imported)
    shas = {}
    for v in range(3):
        if v:
            g = torch.Generator().manual_seed(v)
            weights = {k: t + 1e-3 * torch.randn(t.shape, generator=g) * (i % 2) for i, (k, t) in
                       enumerate(weights.items())}  # half the tensors move, as a step's do
        tmp = st.staging_dir(v)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shas[v], _ = st.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=imported, extra={}, ledger={})
    return st, shas


def test_a_version_from_a_sharded_model_holds_one_weights_file_and_no_index(imported, store):
    st, _ = store
    for v in (0, 2):
        names = {p.name for p in st.path(v).iterdir()}
        assert [n for n in names if n.endswith(".safetensors")] == ["model.safetensors"]
        assert "model.safetensors.index.json" not in names  # vLLM would filter model.safetensors out by it
        # everything else serving reads came from the imported model: config, tokenizer, chat template
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert (st.path(0) / "chat_template.jinja").read_bytes() == (imported / "chat_template.jinja").read_bytes()
    # the tied head is stored once, as in the shards
    assert set(st.manifest(0)["tensors"]) == set(manifest.read(imported)["tensors"])
    for name, digest in manifest.read(imported)["tensors"].items():
        assert st.manifest(0)["tensors"][name] == digest  # the same bytes, consolidated


def test_the_delta_chain_from_a_sharded_model_is_bit_exact(store, tmp_path):
    st, shas = store
    assert not (st.path(1) / "model.safetensors").exists() and (st.path(1) / "delta.fwd").exists()
    cache = CheckpointStore(tmp_path / "cache")
    got = fetch_version(str(st.path(1)), 1, shas[1], cache)
    assert got.seconds["rebuild"] > 0
    assert hashlib.sha256((got.path / "model.safetensors").read_bytes()).hexdigest() == \
        st.manifest(1)["files"]["model.safetensors"]["sha256"]


def test_a_staged_version_with_shards_is_refused(imported, tmp_path):
    st = CheckpointStore(tmp_path / "checkpoints")
    tmp = st.staging_dir(0)
    for s in shards(imported):
        shutil.copy(s, tmp / s.name)
    with pytest.raises(ManifestError, match=r"holds its weights as one model\.safetensors"):
        st.commit(tmp, version=0, parent=None, source_dir=imported, extra={}, ledger={})
    assert st.versions() == []


# -- fetch: a version whose weights are shards ----------------------------------------------------
@pytest.fixture
def sharded_version(imported, tmp_path) -> tuple[Path, str]:
    """The imported directory published as version 5 of a store (full weights, shards, no delta)."""
    d = tmp_path / "remote" / vname(5)
    shutil.copytree(imported, d)
    man = manifest.read(d)
    sha = manifest.write(d, {**man, "version": 5})
    return d, sha


def test_a_sharded_version_is_fetched_whole_and_verified(sharded_version, tmp_path):
    d, sha = sharded_version
    cache = CheckpointStore(tmp_path / "cache")
    got = fetch_version(f"file://{d}", 5, sha, cache)
    assert sorted(p.name for p in shards(got.path)) == sorted(p.name for p in shards(d))
    # nothing rebuilt: no delta, so no parent fetched and no consolidated file made up
    assert cache.versions() == [5] and not (got.path / "model.safetensors").exists()
    assert got.manifest["version"] == 5


def test_a_tampered_shard_is_refused_and_nothing_stays_in_the_cache(sharded_version, tmp_path):
    d, sha = sharded_version
    _flip_last_byte(shards(d)[2])
    cache = CheckpointStore(tmp_path / "cache")
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(d), 5, sha, cache)
    assert err.value.reason == "verification_failed" and "model-00003-of-00006.safetensors" in err.value.detail
    assert cache.versions() == []


def test_a_missing_shard_is_absent_not_rebuilt(sharded_version, tmp_path):
    d, sha = sharded_version
    shards(d)[0].unlink()
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(d), 5, sha, CheckpointStore(tmp_path / "cache"))
    assert err.value.reason == "absent" and "model-00001-of-00006.safetensors" in err.value.detail
    assert (d / MANIFEST_NAME).exists()
