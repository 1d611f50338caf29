"""Fetching a version into a reader's cache: rebuilt from its chain, verified, refused with a reason.

A real store on disk (three versions, the middle one pruned to a delta), read through a plain
path, a ``file://`` URL and a real HTTP server on loopback.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flywheel.checkpoints import MANIFEST_NAME, CheckpointStore, ManifestError
from flywheel.checkpoints.fetch import StoreUnreachable, VersionRefused, fetch_version, prune_cache


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    return {"w": base + 0.01 * seed * torch.randn(64, 32, generator=g), "b": torch.full((32,), float(seed))}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[CheckpointStore, dict[int, str]]:
    root = tmp_path_factory.mktemp("store")
    src = tmp_path_factory.mktemp("src")
    (src / "config.json").write_text('{"model_type": "toy"}')
    st = CheckpointStore(root / "checkpoints", full_every=10, keep_full=1)
    shas = {}
    for v in range(3):
        tmp = st.staging_dir(v)
        save_file(_weights(v), str(tmp / "model.safetensors"))
        shas[v], _ = st.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=src, extra={}, ledger={})
    assert not (st.path(1) / "model.safetensors").exists()  # pruned: only its delta is left
    return st, shas


def _copy(store: CheckpointStore, tmp_path: Path) -> CheckpointStore:
    root = tmp_path / "copy"
    shutil.copytree(store.root, root)
    return CheckpointStore(root, full_every=10, keep_full=1)


@pytest.mark.parametrize("scheme", ["path", "file-url"])
def test_a_pruned_version_is_rebuilt_from_its_chain_and_verified(store, tmp_path, scheme):
    st, shas = store
    uri = str(st.path(1)) if scheme == "path" else f"file://{st.path(1)}"
    cache = CheckpointStore(tmp_path / "cache")
    got = fetch_version(uri, 1, shas[1], cache)
    assert (got.path / "model.safetensors").read_bytes() == st.materialize_bytes(1)
    assert got.manifest["version"] == 1 and (got.path / "config.json").exists()
    assert set(got.seconds) == {"fetch", "rebuild", "verify"} and got.seconds["rebuild"] > 0
    assert cache.versions() == [0, 1]  # the parent it was rebuilt from came along
    assert not (st.path(1) / "model.safetensors").exists()  # the store itself was only read
    again = fetch_version(uri, 1, shas[1], cache)  # cached: verified again, nothing fetched
    assert again.seconds["fetch"] == 0 and again.seconds["verify"] > 0
    prune_cache(cache, {1})
    assert cache.versions() == [1]


def test_a_manifest_other_than_the_announced_one_is_refused_before_any_weights_move(store, tmp_path):
    st, shas = store
    cache = CheckpointStore(tmp_path / "cache")
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(st.path(2)), 2, shas[1], cache)
    assert err.value.reason == "manifest_mismatch" and "announced" in str(err.value)
    assert cache.versions() == [] and not list(cache.root.iterdir())


def test_a_flipped_byte_in_a_delta_is_refused_and_nothing_is_kept(store, tmp_path):
    st, shas = store
    bad = _copy(st, tmp_path)
    delta = bad.path(1) / "delta.fwd"
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    delta.write_bytes(bytes(raw))
    cache = CheckpointStore(tmp_path / "cache")
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(bad.path(1)), 1, shas[1], cache)
    assert err.value.reason == "verification_failed" and "delta.fwd fails hash verification" in err.value.detail
    assert 1 not in cache.versions()


def test_a_truncated_weights_file_is_refused(store, tmp_path):
    st, shas = store
    bad = _copy(st, tmp_path)
    w = bad.path(2) / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(bad.path(2)), 2, shas[2], CheckpointStore(tmp_path / "cache"))
    assert err.value.reason == "verification_failed" and "model.safetensors" in err.value.detail


def test_a_version_absent_from_the_store_is_refused(store, tmp_path):
    st, _shas = store
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(st.root / "v00000009"), 9, "0" * 64, CheckpointStore(tmp_path / "cache"))
    assert err.value.reason == "absent" and "not in the store" in err.value.detail


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(store, tmp_path):
    st, _ = store
    bad = _copy(st, tmp_path)
    path = bad.path(2) / MANIFEST_NAME
    man = json.loads(path.read_text())
    man["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    path.write_text(json.dumps(man))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()  # announced as it is: the name alone is refused
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(bad.path(2)), 2, sha, CheckpointStore(tmp_path / "cache"))
    assert err.value.reason == "malformed" and "unsafe file name" in err.value.detail


def test_a_cached_copy_with_other_bytes_is_replaced_by_the_announced_one(store, tmp_path):
    st, shas = store
    cache = CheckpointStore(tmp_path / "cache")
    fetch_version(str(st.path(2)), 2, shas[2], cache)
    (cache.path(2) / MANIFEST_NAME).write_text("{}")  # someone rewrote the cache
    got = fetch_version(str(st.path(2)), 2, shas[2], cache)
    assert got.seconds["fetch"] > 0 and hashlib.sha256((got.path / MANIFEST_NAME).read_bytes()).hexdigest() == shas[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_over_http_is_unreachable_until_it_answers(store, tmp_path):
    st, shas = store
    port = _free_port()
    uri = f"http://127.0.0.1:{port}/v00000001"
    cache = CheckpointStore(tmp_path / "cache")
    with pytest.raises(StoreUnreachable):
        fetch_version(uri, 1, shas[1], cache)
    handler = partial(_Quiet, directory=str(st.root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = fetch_version(uri, 1, shas[1], cache)  # the delta here, the parent's weights beside it
        assert (got.path / "model.safetensors").read_bytes() == st.materialize_bytes(1)
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hf_store(tiny_model_dir, tmp_path_factory) -> tuple[CheckpointStore, dict[int, str]]:
    """Versions published as the trainer publishes them: its own config.json and weights, its
    DeepSpeed state under ds/, the tokenizer and generation config copied from the model directory."""
    st = CheckpointStore(tmp_path_factory.mktemp("hf") / "checkpoints", full_every=10, keep_full=1)
    shas = {}
    for v in range(3):
        tmp = st.staging_dir(v)
        save_file(_weights(v), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
        (tmp / "ds").mkdir()
        (tmp / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"optimizer state")
        shas[v], _ = st.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=tiny_model_dir,
                               extra={}, ledger={})
    return st, shas


def test_every_file_a_published_version_holds_is_listed_with_its_hash(hf_store, tiny_model_dir):
    st, _ = hf_store
    for v in st.versions():
        files = {p.name for p in st.path(v).iterdir() if p.is_file()} - {MANIFEST_NAME}
        pruned = {"model.safetensors"} if (st.path(v) / "delta.fwd").exists() else set()  # rebuilt on demand
        assert files | pruned == set(st.manifest(v)["files"])
    copied = {p.name for p in tiny_model_dir.iterdir()} - {"model.safetensors", MANIFEST_NAME}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= copied
    assert copied | {"delta.fwd", "ledger.json"} <= set(st.manifest(1)["files"])
    assert (st.path(1) / "ds").is_dir()  # the store's own optimizer state: a directory, never served


def test_the_store_verifies_its_versions_with_their_optimizer_state_beside_them(hf_store, tmp_path):
    st, _ = hf_store
    copy = _copy(st, tmp_path)
    assert not (copy.path(1) / "model.safetensors").exists()
    d = copy.materialize(1)  # rebuilt from its delta: nothing of the rebuild is left beside it
    assert {p.name for p in d.iterdir()} - {"ds", MANIFEST_NAME} == set(copy.manifest(1)["files"])
    assert not list(copy.root.glob(".tmp-*"))
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ManifestError, match="tokenizer.json hash mismatch"):
        copy.materialize(1)


def test_the_store_refuses_a_version_holding_a_file_its_manifest_does_not_list(hf_store, tmp_path):
    st, _ = hf_store
    copy = _copy(st, tmp_path)
    (copy.path(2) / "modeling_evil.py").write_text("import os\n")
    with pytest.raises(ManifestError, match=r"not in the manifest: \['modeling_evil.py'\]"):
        copy.materialize(2)
    with pytest.raises(ManifestError, match="modeling_evil.py"):
        copy.export(2, tmp_path / "out")


def test_a_fetch_copies_only_what_the_manifest_lists_and_verifies_all_of_it(hf_store, tmp_path):
    st, shas = hf_store
    src = _copy(st, tmp_path)
    (src.path(1) / "modeling_evil.py").write_text("import os\n")  # in the store, listed nowhere
    cache = CheckpointStore(tmp_path / "cache")
    got = fetch_version(str(src.path(1)), 1, shas[1], cache)  # rebuilt from the parent's weights
    assert {p.name for p in got.path.iterdir()} == {MANIFEST_NAME, *got.manifest["files"]}
    (got.path / "tokenizer_config.json").write_text('{"auto_map": {}}')  # the cache is rewritten
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(src.path(1)), 1, shas[1], cache)
    assert err.value.reason == "verification_failed" and "tokenizer_config.json hash mismatch" in err.value.detail
    fetch_version(str(src.path(1)), 1, shas[1], cache)
    (cache.path(1) / "pytorch_model.bin").write_bytes(b"planted")
    with pytest.raises(VersionRefused) as err:
        fetch_version(str(src.path(1)), 1, shas[1], cache)
    assert err.value.reason == "verification_failed" and "['pytorch_model.bin']" in err.value.detail
    assert 1 not in cache.versions()
