"""Importing a local Hugging Face directory (flywheel/hfimport.py): what is copied and hashed, and
every refusal, each with the file and the reason, leaving no half-written directory.

The source is a tiny tied-embedding Llama saved in six shards (tests/hf_helpers.py). Whether
serving and the trainer can load the result is the ``check`` callback's business: the real
checks are tested in tests/integration/test_model_import.py; here a recording check stands in
only where the import's own bookkeeping is under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_helpers import shards

from flywheel.checkpoints import MANIFEST_NAME, manifest
from flywheel.hfimport import HfImportError, import_hf_dir, read_hf_dir


@pytest.fixture
def source(sharded_hf_dir) -> Path:
    return sharded_hf_dir


@pytest.fixture
def src(source, tmp_path) -> Path:
    """A copy each test may break."""
    return Path(shutil.copytree(source, tmp_path / "src"))


def test_a_sharded_tied_directory_imports_with_every_shard_hashed(source, tmp_path):
    checked = []
    out = tmp_path / "out"
    hf = import_hf_dir(source, out, check=lambda d: checked.append(sorted(p.name for p in d.iterdir())))
    assert len(hf.weights) == len(shards(source)) >= 4 and hf.index == "model.safetensors.index.json"
    assert hf.tied_embeddings is True and hf.chat_template == "chat_template.jinja"
    # the check saw every file but the manifest: it is written only once the check passed
    assert checked and MANIFEST_NAME not in checked[0] and "model-00001-of-00006.safetensors" in checked[0]
    man = manifest.verify_dir(out)
    assert man["version"] == 0 and man["parent"] is None and man["step"] == 0
    assert set(man["files"]) == {p.name for p in source.iterdir()}  # shards, index, config, tokenizer, template
    for shard in shards(source):  # kept byte for byte, as the source's own shards
        assert man["files"][shard.name]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    # every tensor across the shards, once; the tied head is not stored a second time
    tensors = {k for s in shards(source) for k in load_file(str(s))}
    assert set(man["tensors"]) == tensors and "lm_head.weight" not in tensors
    assert man["imported_from"]["tied_embeddings"] is True and man["imported_from"]["weights"] == list(hf.weights)


def test_a_failed_check_leaves_nothing_and_the_directory_can_be_imported_into_again(source, tmp_path):
    out = tmp_path / "out"

    def refuse(_d: Path) -> None:
        raise HfImportError("the trainer cannot load it: for this test")

    with pytest.raises(HfImportError, match="for this test"):
        import_hf_dir(source, out, check=refuse)
    assert not out.exists()
    out.mkdir()  # an empty directory given by the user stays, emptied
    with pytest.raises(HfImportError):
        import_hf_dir(source, out, check=refuse)
    assert out.is_dir() and not any(out.iterdir())
    import_hf_dir(source, out)
    manifest.verify_dir(out)


def test_files_loaders_do_not_need_are_left_out_and_named(src, tmp_path):
    (src / "README.md").write_text("# model card")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")  # beside safetensors: never copied
    (src / "original").mkdir()
    hf = import_hf_dir(src, tmp_path / "out")
    assert hf.left_out == ("README.md", "original/", "pytorch_model.bin")
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()


def test_pickle_only_weights_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(HfImportError, match=r"only as pickle files \(pytorch_model\.bin\).*unpickling runs code"):
        import_hf_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_tokenizer_is_refused(src, tmp_path):
    (src / "tokenizer.json").unlink()
    with pytest.raises(HfImportError, match="has no tokenizer"):
        import_hf_dir(src, tmp_path / "out")


def test_an_index_naming_a_missing_shard_is_refused(src, tmp_path):
    shards(src)[2].unlink()
    with pytest.raises(HfImportError, match=r"names the shard model-00003-of-00006\.safetensors, which is missing"):
        import_hf_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_shard_holding_other_tensors_than_its_index_says_is_refused(src, tmp_path):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(k for k, v in index["weight_map"].items() if v != "model-00001-of-00006.safetensors")
    index["weight_map"][name] = "model-00001-of-00006.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HfImportError, match="does not hold the tensors"):
        import_hf_dir(src, tmp_path / "out")


def test_a_weight_file_the_index_does_not_name_is_refused(src, tmp_path):
    # a consolidated copy left beside the shards: vLLM would load it too
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(src / "consolidated.safetensors"))
    with pytest.raises(HfImportError, match=r"consolidated\.safetensors not named by model\.safetensors\.index"):
        import_hf_dir(src, tmp_path / "out")


def test_a_tensor_in_two_shards_is_refused(src, tmp_path):
    first, second = shards(src)[:2]
    extra = {**load_file(str(second)), **{k: v for k, v in list(load_file(str(first)).items())[:1]}}
    save_file(extra, str(second), metadata={"format": "pt"})
    with pytest.raises(HfImportError, match="is in both"):
        import_hf_dir(src, tmp_path / "out")


def test_a_truncated_shard_is_refused(src, tmp_path):
    shard = shards(src)[3]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(HfImportError, match=r"model-00004-of-00006\.safetensors is \d+ bytes, its header describes"):
        import_hf_dir(src, tmp_path / "out")


def test_several_weight_files_without_an_index_are_refused(src, tmp_path):
    (src / "model.safetensors.index.json").unlink()
    with pytest.raises(HfImportError, match="without a model.safetensors.index.json"):
        import_hf_dir(src, tmp_path / "out")


def test_a_hub_cache_file_whose_bytes_do_not_match_its_blob_name_is_refused(source, tmp_path):
    # the hub cache's layout: snapshots/<rev>/<file> -> ../../blobs/<sha256 of the file>
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in source.iterdir():
        blob = blobs / hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blob)
        os.symlink(os.path.relpath(blob, snap), snap / p.name)
    assert read_hf_dir(snap).sha256  # a whole cache snapshot reads, every blob name checked
    victim = (snap / shards(source)[1].name).resolve()
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(HfImportError, match=r"model-00002-of-00006\.safetensors: hash mismatch with its cache blob"):
        import_hf_dir(snap, tmp_path / "out")


def test_a_file_that_does_not_match_the_etag_its_download_recorded_is_refused(src, tmp_path):
    # what `huggingface-cli download --local-dir` leaves: commit, ETag (sha256 for LFS files), time
    shard = shards(src)[0]
    meta = src / ".cache" / "huggingface" / "download" / f"{shard.name}.metadata"
    meta.parent.mkdir(parents=True)
    good = hashlib.sha256(shard.read_bytes()).hexdigest()
    meta.write_text(f"{'c' * 40}\n{good}\n{shard.stat().st_mtime + 5}\n")
    assert read_hf_dir(src).sha256[shard.name] == good
    meta.write_text(f"{'c' * 40}\n{'0' * 64}\n{shard.stat().st_mtime + 5}\n")
    with pytest.raises(HfImportError, match="hash mismatch with the ETag its download recorded"):
        import_hf_dir(src, tmp_path / "out")


def test_a_flywheel_directory_that_fails_its_own_manifest_is_refused(source, tmp_path):
    once = tmp_path / "once"
    import_hf_dir(source, once)
    again = import_hf_dir(once, tmp_path / "again")  # an imported or exported directory imports again
    assert again.sha256 == read_hf_dir(source).sha256
    shard = shards(once)[4]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one weight's last bit: still a valid safetensors file
    shard.write_bytes(bytes(data))
    with pytest.raises(HfImportError, match=r"fails its own flywheel-manifest\.json: .*00005-of-00006\.safetensors hash"):
        import_hf_dir(once, tmp_path / "third")


def test_a_non_empty_out_directory_and_a_missing_source_are_refused(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(HfImportError, match="not empty"):
        import_hf_dir(source, out)
    with pytest.raises(HfImportError, match="no such directory"):
        import_hf_dir(tmp_path / "nope", tmp_path / "out2")
