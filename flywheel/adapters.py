"""Loading a published version as one model, whether it holds full weights or a LoRA adapter.

A version the trainer published in LoRA mode is a PEFT adapter directory whose manifest names its
base model by the sha256 of the base's manifest (flywheel/checkpoints/manifest.py). Readers that
need a plain transformers model of a version (the release gate scores one; ``flywheel checkpoint
merge`` writes one) call :func:`load_causal_lm` with the version's verified directory and the base
directory they hold (their ``model_dir``): a full version loads as it is; an adapter is applied on
the base only after :func:`~flywheel.checkpoints.verify_base` has checked every file of the base
against the hash the adapter recorded, then merged into it (exact in float32, and a merged model
runs as fast as the base).

:func:`merge_version` writes such a merged model as a full-weight Hugging Face directory with a
manifest: what a release engineer publishes when a deployment must serve full weights (vLLM
without LoRA, another engine) or start training a new base. Serving adapters without merging is
vLLM's LoRA support, which loads the adapter directory as it is.

Torch, transformers and PEFT load when a function is called, never at import.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from flywheel.checkpoints import manifest
from flywheel.checkpoints.manifest import (
    MANIFEST_NAME,
    Adapter,
    ManifestError,
    adapter_of,
    verify_base,
)
from flywheel.progress import SILENT, Progress


def adapter_in(version_dir: Path) -> Adapter | None:
    """The adapter a version directory holds, by its manifest; None for full weights (a model
    directory without a manifest, which a caller verified some other way, holds full weights)."""
    path = Path(version_dir) / MANIFEST_NAME
    return adapter_of(manifest.read(Path(version_dir))) if path.is_file() else None


def model_home(version_dir: Path, base_dir: Path) -> Path:
    """Where a version's config and tokenizer are: an adapter carries neither (its base does)."""
    return Path(base_dir) if adapter_in(version_dir) is not None else Path(version_dir)


def load_causal_lm(version_dir: Path, base_dir: Path, dtype: Any = None) -> Any:
    """A transformers causal LM of the version in ``version_dir`` (already verified by the caller:
    fetch, the store's materialize or export), in ``dtype`` (float32 by default). An adapter is
    applied on ``base_dir`` once the base is proved to be the one it names, and merged."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    version_dir = Path(version_dir)
    adapter = adapter_in(version_dir)
    if adapter is None:
        return AutoModelForCausalLM.from_pretrained(str(version_dir), dtype=dtype)
    verify_base(base_dir, adapter)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    return PeftModel.from_pretrained(base, str(version_dir)).merge_and_unload()


def merge_version(version_dir: Path, base_dir: Path, out: Path, progress: Progress = SILENT) -> dict[str, Any]:
    """Write the adapter version in ``version_dir`` merged into ``base_dir`` as a full-weight model
    directory ``out``, in the base's dtype, with the base's config and tokenizer and a manifest
    (version and parent as the adapter's; ``merged`` names the adapter's manifest hash and its
    base). ``out`` must not exist. Returns the manifest; raises :class:`ManifestError` for a
    version that is no adapter or a base that is not its own."""
    import torch

    version_dir, base_dir, out = Path(version_dir), Path(base_dir), Path(out)
    man = manifest.read(version_dir)
    adapter = adapter_of(man)
    if adapter is None:
        raise ManifestError(f"version {man.get('version')} holds full weights already: nothing to merge "
                            "(flywheel checkpoint reconstruct exports it)")
    if out.exists():
        raise ManifestError(f"{out} exists; merge writes a new directory")
    config = json.loads((base_dir / "config.json").read_text())
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    model = load_causal_lm(version_dir, base_dir)  # verifies the base
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        written = {p.name for p in tmp.iterdir()}
        for p in base_dir.iterdir():  # tokenizer, chat template, the base's own config
            if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith((".safetensors", ".safetensors.index.json")) \
                    and (p.name not in written or p.name == "config.json"):
                shutil.copy2(p, tmp / p.name)
        merged = {"adapter_manifest_sha256": manifest.sha256_file(version_dir / MANIFEST_NAME), **adapter.to_json()}
        result = manifest.build(tmp, version=man["version"], parent=man.get("parent"),
                                extra={"step": man.get("step", 0), "merged": merged}, progress=progress)
        manifest.write(tmp, result)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
