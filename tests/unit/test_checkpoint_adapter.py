"""Adapter versions (LoRA) in the checkpoint store: published, chained by deltas, fetched, verified
and refused exactly as full versions are, and refused on any base but the one they name.

A real store on disk with PEFT-named adapter tensors; the base is a model directory with its own
manifest, as ``flywheel model init`` and ``flywheel model import`` write it. Training real adapters
is tests/integration/test_trainer_lora.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flywheel.checkpoints import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    WEIGHTS,
    Adapter,
    CheckpointStore,
    ManifestError,
    adapter_of,
    manifest,
    verify_base,
)
from flywheel.checkpoints.fetch import VersionRefused, fetch_version
from flywheel.contracts import CheckpointEvent, ReleaseEvent, VersionRef, decode, encode
from trainer.announce import checkpoint_event

PREFIX = "base_model.model.model.layers.0.self_attn"


def _base(directory: Path, seed: int) -> Path:
    """A model directory with a manifest (the adapter's base)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "toy", "dtype": "float32"}')
    save_file({"w": torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))}, str(directory / WEIGHTS))
    manifest.write(directory, manifest.build(directory, version=0, parent=None))
    return directory


def _adapter_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"{PREFIX}.{m}_proj.lora_{ab}.weight": torch.randn(*((4, 16) if ab == "A" else (16, 4)), generator=g) * step
            for m in ("q", "v") for ab in ("A", "B")}


def _publish(st: CheckpointStore, version: int, adapter: Adapter | None, source: Path) -> str:
    tmp = st.staging_dir(version)
    if adapter is None:
        save_file({"w": torch.full((16, 16), float(version))}, str(tmp / WEIGHTS))
    else:
        save_file(_adapter_tensors(version), str(tmp / ADAPTER_WEIGHTS))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                     "target_modules": ["q_proj", "v_proj"]}))
    parent = version - 1 if version else None
    sha, _ = st.commit(tmp, version=version, parent=parent, source_dir=source, extra={"step": version}, ledger={},
                       adapter=adapter)
    return sha


@pytest.fixture
def store(tmp_path) -> tuple[CheckpointStore, Adapter, dict[int, str], Path]:
    base = _base(tmp_path / "base", seed=0)
    adapter = Adapter("base", manifest.sha256_file(base / MANIFEST_NAME), 4, 8.0, ("q_proj", "v_proj"))
    st = CheckpointStore(tmp_path / "checkpoints", full_every=10, keep_full=1)
    shas = {v: _publish(st, v, adapter, base) for v in range(3)}
    return st, adapter, shas, base


def test_an_adapter_version_is_a_peft_directory_whose_manifest_names_its_base(store):
    st, adapter, _, base = store
    files = sorted(p.name for p in st.path(2).iterdir())
    # the model's config and tokenizer are the base's: a PEFT directory carries none of them
    assert files == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "delta.fwd", MANIFEST_NAME, "ledger.json"]
    man = st.manifest(2)
    assert adapter_of(man) == adapter and manifest.weights_name(man) == ADAPTER_WEIGHTS
    assert man["full_snapshot"] is False and man["parent"] == 1
    assert verify_base(base, adapter_of(man))["version"] == 0


def test_an_adapter_chain_is_pruned_to_deltas_and_rebuilt_bit_exact(store, tmp_path):
    st, _, shas, _ = store
    assert not (st.path(1) / ADAPTER_WEIGHTS).exists()  # pruned: only its delta is left
    expected = tmp_path / "expected.safetensors"
    save_file(_adapter_tensors(1), str(expected))
    assert st.materialize_bytes(1) == expected.read_bytes()
    cache = CheckpointStore(tmp_path / "cache")
    got = fetch_version(str(st.path(1)), 1, shas[1], cache)
    assert (got.path / ADAPTER_WEIGHTS).read_bytes() == expected.read_bytes()
    assert adapter_of(got.manifest) is not None


@pytest.mark.parametrize("target", [ADAPTER_WEIGHTS, ADAPTER_CONFIG, "delta.fwd"])
def test_a_flipped_byte_in_an_adapter_version_is_refused(store, tmp_path, target):
    st, _, shas, _ = store
    version = 1 if target == "delta.fwd" else 2
    path = st.path(version) / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=target):
        st.materialize(version)
    with pytest.raises(VersionRefused) as refused:
        fetch_version(str(st.path(version)), version, shas[version], CheckpointStore(tmp_path / "cache"))
    assert refused.value.reason == "verification_failed"


def test_an_adapter_version_under_a_wrong_manifest_hash_is_refused(store, tmp_path):
    st, _, shas, _ = store
    with pytest.raises(VersionRefused) as refused:
        fetch_version(str(st.path(2)), 2, shas[1], CheckpointStore(tmp_path / "cache"))
    assert refused.value.reason == "manifest_mismatch"


def test_an_adapter_is_refused_on_another_base_or_a_tampered_one(store, tmp_path):
    _, adapter, _, base = store
    other = _base(tmp_path / "other", seed=1)
    with pytest.raises(ManifestError, match="another model"):
        verify_base(other, adapter)
    no_manifest = tmp_path / "bare"
    shutil.copytree(base, no_manifest)
    (no_manifest / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="no flywheel-manifest.json"):
        verify_base(no_manifest, adapter)
    # the right manifest beside weights that are not the ones it lists
    weights = base / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="hash mismatch"):
        verify_base(base, adapter)


def test_a_version_of_another_kind_or_base_starts_a_new_chain(tmp_path):
    base = _base(tmp_path / "base", seed=0)
    a = Adapter("base", manifest.sha256_file(base / MANIFEST_NAME), 4, 8.0, ("q_proj", "v_proj"))
    b = Adapter("other", hashlib.sha256(b"other").hexdigest(), 4, 8.0, ("q_proj", "v_proj"))
    st = CheckpointStore(tmp_path / "checkpoints", full_every=10, keep_full=5)
    for v, kind in enumerate([None, a, a, b]):
        _publish(st, v, kind, base)
    assert [st.manifest(v)["full_snapshot"] for v in range(4)] == [True, True, False, True]
    assert [adapter_of(st.manifest(v)) for v in range(4)] == [None, a, a, b]


def test_a_staged_adapter_without_its_config_is_not_published(tmp_path):
    base = _base(tmp_path / "base", seed=0)
    a = Adapter("base", manifest.sha256_file(base / MANIFEST_NAME), 4, 8.0, ("q_proj",))
    st = CheckpointStore(tmp_path / "checkpoints")
    tmp = st.staging_dir(0)
    save_file(_adapter_tensors(0), str(tmp / ADAPTER_WEIGHTS))
    with pytest.raises(ManifestError, match=ADAPTER_CONFIG):
        st.commit(tmp, version=0, parent=None, source_dir=base, extra={}, ledger={}, adapter=a)
    assert st.versions() == []


def test_announcements_and_release_refs_say_which_base_an_adapter_needs(store, tmp_path):
    st, adapter, shas, base = store
    event = decode(CheckpointEvent, encode(checkpoint_event(st, 2)))
    assert event.base is not None and event.base.manifest_sha256 == adapter.base_manifest_sha256
    assert event.base.name == "base" and event.manifest_sha256 == shas[2]
    ref = VersionRef(version=2, uri=event.uri, manifest_sha256=event.manifest_sha256, base=event.base)
    release = decode(ReleaseEvent, encode(ReleaseEvent(revision=1, stable_version=2, stable_ref=ref, updated_at=1.0)))
    assert release.stable_ref.base == event.base
    # a full version's records carry no base, byte for byte as before adapters existed
    full = CheckpointStore(tmp_path / "full")
    _publish(full, 0, None, base)
    raw = encode(checkpoint_event(full, 0))
    assert decode(CheckpointEvent, raw).base is None and b'"base"' not in raw
    assert b'"base"' not in encode(VersionRef(version=1, uri="x", manifest_sha256=shas[0]))
