"""Published versions from real DeepSpeed steps: chain reconstruction is bit-exact, tampering fails.

No broker here: the trainer's publish path is driven directly (the Kafka loop has its own test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import ROOT, ListSink, make_trainer, reward_event

from flywheel.checkpoints import ManifestError, manifest
from flywheel.metrics import new_registry

pytestmark = pytest.mark.integration




@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    """Seven versions of real training, bf16 served weights, a full snapshot every 3rd version."""
    data = tmp_path_factory.mktemp("store")
    tr = make_trainer(tiny_model_dir, data, loss="reinforce", lr=1e-4, full_every=3, keep_full=2, served_dtype="bfloat16")
    tr.start()
    i = 0
    for _ in range(6):
        for _ in range(2):
            events = [reward_event(i + k) for k in range(4)]
            tr._train(events, [("t", 0, i + k) for k in range(4)])
            i += 4
        tr.publish()
    return tr


def test_chain_is_bit_exact_and_pruned(chain):
    store = chain.store
    assert store.versions() == list(range(7))
    # old non-snapshot versions keep only their delta; snapshots (0, 3, 6) and the newest keep weights
    assert [(store.path(v) / "model.safetensors").exists() for v in range(7)] == [True, False, False, True, False, True, True]
    live = {k: v.to(device="cpu", dtype=torch.bfloat16) for k, v in chain.policy.module.state_dict().items()}
    for v in range(7):
        data = store.materialize_bytes(v)
        man = store.manifest(v)
        assert man["dtype"] == "BF16" and man["full_snapshot"] == (v % 3 == 0)
        if v == 6:
            from safetensors.torch import load

            got = load(data)
            assert all(torch.equal(got[k], live[k]) for k in live)
    m5 = store.manifest(5)
    assert m5["parent"] == 4 and m5["delta_ratio"] > 1.5 and m5["step"] == 10 and m5["samples"] == 8
    assert store.ledger(5)["trained"] == [f"gen-{i}" for i in range(32, 40)]


def test_versions_moved_every_trainable_tensor(chain):
    a = load_file(str(chain.store.materialize(0) / "model.safetensors"))
    b = load_file(str(chain.store.materialize(6) / "model.safetensors"))
    unchanged = [k for k in a if torch.equal(a[k], b[k])]
    # Norm gains start at exactly 1.0, where one bf16 ulp is 2**-7: a dozen steps at lr 1e-4
    # move them less than half an ulp, so in the served precision they are legitimately unchanged.
    assert unchanged and all("norm" in k for k in unchanged)
    assert any("norm" not in k for k in a)


def test_materialize_restores_a_loadable_verified_directory(chain, tmp_path):
    out = chain.store.export(4, tmp_path / "v4")
    manifest.verify_dir(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert (out / "tokenizer.json").exists()


def test_every_file_the_trainer_publishes_is_in_its_manifest(chain, tmp_path):
    """What a publish writes (config, tokenizer, generation config, ledger, delta) is hashed, so
    verified; only the optimizer state under ds/ is the store's own, and an export leaves it out."""
    store = chain.store
    for v in store.versions():
        entries = {p.name for p in store.path(v).iterdir()} - {manifest.MANIFEST_NAME}
        listed = set(store.manifest(v)["files"])
        assert entries - listed <= {"ds"}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "ledger.json"} <= listed
    assert (store.path(6) / "ds").is_dir()
    out = store.export(5, tmp_path / "v5")
    assert {p.name for p in out.iterdir()} == {manifest.MANIFEST_NAME, *store.manifest(5)["files"]}


def test_flipped_byte_in_a_delta_is_detected(chain, tmp_path):
    import shutil

    from flywheel.checkpoints import CheckpointStore

    root = tmp_path / "copy"
    shutil.copytree(chain.store.root, root)
    store = CheckpointStore(root, full_every=3, keep_full=2)
    delta = root / "v00000002" / "delta.fwd"
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    delta.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="version 2: delta.fwd fails hash verification"):
        store.materialize_bytes(2)
    store.materialize_bytes(4)  # 4 rebuilds from the snapshot at 3: unaffected


def test_tampered_weights_are_detected_by_the_cli(chain, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(chain.store.root, root)
    w = root / "v00000003" / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-10] ^= 0x80
    w.write_bytes(bytes(raw))
    (root / "v00000004" / "model.safetensors").unlink(missing_ok=True)  # force the chain walk 3 -> 4
    env = {"FLYWHEEL_TRAINER_STORE": str(root), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "cli", "checkpoint", "verify"]
    bad = subprocess.run([*cmd, "4"], check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "model.safetensors fails hash verification" in bad.stderr
    good = subprocess.run([*cmd, "2"], check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    assert good.returncode == 0 and "OK" in good.stdout


def test_intake_drops_stale_and_dead_letters_unknown_versions(chain):
    """At trainer version 6 with max_staleness 4: v1 is stale (counted), v9 is unknown (dead letter)."""
    from collections import namedtuple

    from flywheel.contracts import DeadLetterEvent, decode, encode
    from flywheel.stream.deadletters import DeadLetters

    Rec = namedtuple("Rec", "topic partition offset key value headers")
    sink = ListSink()
    chain.deadletters = DeadLetters(sink, "dl", "trainer_test", new_registry())
    assert chain.version == 6 and chain.cfg.max_staleness == 4
    recs = [Rec("r", 0, 100 + i, f"k{i}".encode(), encode(reward_event(500 + i, version=v)), [])
            for i, v in enumerate([1, 2, 9])]
    for rec in recs:
        chain._intake(rec)
    assert chain.ledger.dropped["stale"] == ["gen-500"]
    assert chain.ledger.dropped["unknown_version"] == ["k2"]
    assert [decode(DeadLetterEvent, v).reason for _, _, v in sink.records] == ["unknown_version"]
    assert [s.event.generation_id for s in chain.batcher.waiting()] == ["gen-501"]  # staleness 4 is allowed
    assert chain.m.dropped.labels("stale")._value.get() == 1
    assert chain.book.is_settled("r", 0, 100) and not chain.book.is_settled("r", 0, 101)


def test_publish_to_an_fsspec_url(chain):
    import fsspec

    from flywheel.checkpoints import ObjectStore

    uri = ObjectStore("memory://bucket/ckpt").publish(chain.store.path(6))
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(uri.removeprefix("memory:/"), detail=False)}
    assert {"flywheel-manifest.json", "model.safetensors", "config.json", "ledger.json"} <= names
    assert fs.cat(f"{uri.removeprefix('memory:/')}/model.safetensors") == (chain.store.path(6) / "model.safetensors").read_bytes()


def _counted(counter, **labels: str) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels == labels)


def test_usage_counts_the_tokens_each_version_trained_on(chain, capsys):
    """``flywheel usage`` reads each version's ledger: its samples and their tokens, the same
    numbers the trainer counted in ``trainer_trained_tokens_total`` as it trained them."""
    from cli.main import main

    want = {}
    for v in range(1, 7):  # the fixture trained 8 records into each version after v0
        events = [reward_event(i) for i in range(8 * (v - 1), 8 * v)]
        want[v] = (8, sum(len(e.prompt_token_ids) for e in events), sum(len(e.completion_token_ids) for e in events))
    root = chain.store.root
    assert main(["usage", "--checkpoints", str(root), "--archive", str(root / "no-archive"), "-o", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {r["version"]: (r["samples"], r["prompt_tokens"], r["completion_tokens"]) for r in got["trained"]} == want
    assert got["trained_total"] == {"samples": 48, "prompt_tokens": sum(w[1] for w in want.values()),
                                    "completion_tokens": sum(w[2] for w in want.values())}
    for v, (_, prompt, completion) in want.items():
        assert _counted(chain.m.trained_tokens, version=str(v), kind="prompt") == prompt
        assert _counted(chain.m.trained_tokens, version=str(v), kind="completion") == completion
    assert main(["usage", "--checkpoints", str(root), "--archive", str(root / "no-archive")]) == 0
    table = capsys.readouterr().out
    tot = got["trained_total"]
    assert table.splitlines()[-1].split() == ["total", "48", f"{tot['prompt_tokens']:,}", f"{tot['completion_tokens']:,}"]
    assert table.splitlines()[-2].split()[0] == "v6"
