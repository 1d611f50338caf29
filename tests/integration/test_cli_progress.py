"""Progress bars of the commands that pass over gigabytes (``checkpoint verify``, ``reconstruct``,
``merge``, ``model import``): drawn on stderr when it is a terminal, never on stdout, and not at
all when stderr is a pipe (flywheel/progress.py).

Each command runs as a real process (``python -m cli``) twice: once with stderr on a
pseudo-terminal (the pty module, sized 120 columns, as a person's terminal is) and stdout on a
pipe, once with both on pipes, as a script or a job runs it. The store is a real one on disk,
written through :meth:`CheckpointStore.commit`, with a version pruned to its delta so ``verify``
rebuilds it from its chain. ``merge`` and ``model import`` load torch, transformers and vLLM's
config: they are the slow test.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from flywheel.checkpoints import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    WEIGHTS,
    Adapter,
    CheckpointStore,
)
from flywheel.checkpoints import manifest as manifests

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: What tqdm draws and nothing else prints: a percentage beside a bar's edge.
BAR = "%|"


def run_both_ways(argv: list[str], env: dict[str, str], timeout_s: float = 300) -> tuple[dict, dict]:
    """``python -m cli *argv`` with stderr on a terminal, then on a pipe: for each, the exit code,
    stdout and stderr (the terminal's bytes decoded). ``{run}`` in an argument is ``tty`` or
    ``pipe``: the two runs write to places of their own."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | env
    clean |= {"FLYWHEEL_LOG_LEVEL": "WARNING", "TERM": "xterm"}
    cmd = [sys.executable, "-m", "cli", *(a.format(run="tty") for a in argv)]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    seen = bytearray()

    def drain() -> None:  # read as it is written: a full pty buffer would block the command
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        out, _ = proc.communicate(timeout=timeout_s)
        reader.join(10)
    finally:
        os.close(master)
    tty = {"code": proc.returncode, "out": out.decode(), "err": seen.decode("utf-8", "replace")}
    cmd = [sys.executable, "-m", "cli", *(a.format(run="pipe") for a in argv)]
    done = subprocess.run(cmd, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=timeout_s, check=False)
    return tty, {"code": done.returncode, "out": done.stdout, "err": done.stderr}


def assert_quiet(result: dict) -> None:
    assert BAR not in result["err"] and "\r" not in result["err"], result["err"][-2000:]
    assert BAR not in result["out"] and "\r" not in result["out"]


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory) -> Path:
    """A store of three full-weight versions; v1 keeps only its delta (rebuilt from v0)."""
    root = tmp_path_factory.mktemp("store")
    store = CheckpointStore(root, full_every=10, keep_full=1)
    weights = bytearray((tiny_model_dir / WEIGHTS).read_bytes())
    for version in range(3):
        tmp = store.staging_dir(version)
        if version:
            weights[-4096 * version] ^= 0x01  # a value in the data section moved: a small delta
        (tmp / WEIGHTS).write_bytes(bytes(weights))
        store.commit(tmp, version=version, parent=version - 1 if version else None, source_dir=tiny_model_dir,
                     extra={"step": version}, ledger={})
    assert not (store.path(1) / WEIGHTS).exists() and (store.path(1) / "delta.fwd").exists()
    return root


def test_checkpoint_verify_and_reconstruct_show_progress_on_a_terminal_only(chain, tmp_path):
    env = {"FLYWHEEL_TRAINER_STORE": str(chain)}
    size = (chain / "v00000000" / WEIGHTS).stat().st_size

    tty, piped = run_both_ways(["checkpoint", "verify", "1"], env)
    answer = f"version 1: OK ({size} weight bytes verified)\n"
    assert (tty["code"], tty["out"]) == (0, answer), tty["err"][-2000:]  # stdout: the answer alone
    assert "rebuild v1 from v0 + 1 deltas" in tty["err"] and "100%|" in tty["err"], tty["err"][-2000:]
    assert (piped["code"], piped["out"]) == (0, answer)
    assert_quiet(piped)

    tty, piped = run_both_ways(["checkpoint", "reconstruct", "1", str(tmp_path / "{run}")], env)
    for run, result in (("tty", tty), ("pipe", piped)):
        assert (result["code"], result["out"]) == (0, f"version 1 written to {tmp_path / run}\n"), result["err"]
        assert manifests.verify_dir(tmp_path / run)["version"] == 1
    for step in ("copy to tty", "verify files of tty", "hash tensors of v00000001"):
        assert step in tty["err"], (step, tty["err"][-2000:])
    assert_quiet(piped)


def _adapter_store(root: Path, base: Path) -> CheckpointStore:
    """One LoRA version on the tiny model (rank 4 on q and v of both layers)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for proj, width in (("q_proj", hidden), ("v_proj", kv)):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(4, hidden, generator=g) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, 4, generator=g) * 0.01
    store = CheckpointStore(root)
    tmp = store.staging_dir(0)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
                                                 "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    adapter = Adapter(base.name, manifests.sha256_file(base / MANIFEST_NAME), 4, 8.0, ("q_proj", "v_proj"))
    store.commit(tmp, version=0, parent=None, source_dir=base, extra={"step": 0}, ledger={}, adapter=adapter)
    return store


@pytest.mark.slow  # ~40 s: torch, transformers and PEFT for merge, vLLM's config check for import, twice each
def test_merge_and_model_import_show_progress_on_a_terminal_only(tiny_model_dir, sharded_hf_dir, tmp_path):
    store = _adapter_store(tmp_path / "store", tiny_model_dir)
    env = {"FLYWHEEL_TRAINER_STORE": str(store.root), "FLYWHEEL_MODEL_DIR": str(tiny_model_dir)}
    tty, piped = run_both_ways(["checkpoint", "merge", "0", str(tmp_path / "merged-{run}")], env)
    for result in (tty, piped):  # stdout: the answer alone (DeepSpeed's accelerator warning went there)
        assert result["code"] == 0 and result["out"].startswith("version 0 merged into its base"), result
        assert result["out"].count("\n") == 1 and BAR not in result["out"]
    assert "hash files of .merged-tty.partial" in tty["err"] and "100%|" in tty["err"], tty["err"][-2000:]
    assert_quiet(piped)
    assert manifests.verify_dir(tmp_path / "merged-pipe")["merged"]["base_manifest_sha256"]

    tty, piped = run_both_ways(["model", "import", str(sharded_hf_dir), str(tmp_path / "imported-{run}")], {})
    for result in (tty, piped):
        assert result["code"] == 0 and result["out"].startswith("model imported from"), result
        assert "WARNING" not in result["out"] and BAR not in result["out"], result["out"]
    for step in (f"hash {sharded_hf_dir.name}", "copy to imported-tty", "hash files of imported-tty",
                 "hash tensors of imported-tty"):
        assert step in tty["err"], (step, tty["err"][-3000:])
    assert_quiet(piped)
