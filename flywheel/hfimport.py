"""Import a local Hugging Face model directory (``flywheel model import DIR OUT``).

Real models ship as a Hugging Face directory: ``config.json``, tokenizer files with the chat
template, and safetensors weights, one file or many shards named by
``model.safetensors.index.json``. This reads such a directory, refuses what Flywheel must not or
cannot serve, copies what serving and the trainer read into a new model directory, has the
caller check that both can load it, and writes the manifest (version 0) last.

Refused, each with the file and the reason:

- weights only as pickles (``pytorch_model.bin``, ``*.pt``): unpickling runs code, so Flywheel
  loads safetensors only;
- no tokenizer (``tokenizer.json``, ``tokenizer.model``, ``vocab.json``, ...);
- an index naming a shard that is missing, a shard holding other tensors than its index says, a
  ``*.safetensors`` file the index does not name (vLLM would load it beside the shards), several
  weight files without an index, a tensor in two files, a truncated or malformed shard;
- a file whose bytes do not match a hash the directory carries for it: the blob name of a Hugging
  Face cache snapshot, the ETag ``huggingface-cli download --local-dir`` records, or a Flywheel
  manifest already in the directory;
- a file that changed while it was copied.

The shards are kept as they are: vLLM and transformers read sharded weights natively, and each
shard is a file of the manifest, hash-verified before serving. The trainer publishes later
versions as one consolidated ``model.safetensors`` (see :mod:`flywheel.checkpoints.store`).

Tied embeddings need nothing special: a model that ties its output head to its input embeddings
stores the tensor once, and every loader ties the head again from the config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flywheel.checkpoints import manifest
from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError
from flywheel.checkpoints.store import copy_file
from flywheel.progress import SILENT, Progress

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".safetensors.index.json"
#: Weight formats loaders read by unpickling: never copied, and refused when they are all there is.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Files that make a tokenizer's vocabulary; at least one must be present.
TOKENIZER_VOCAB = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
#: Everything besides weights that serving (vLLM, the chat template) and the trainer read.
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_VOCAB, "merges.txt", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_HEX64, _HEX40 = re.compile(r"[0-9a-f]{64}"), re.compile(r"[0-9a-f]{40}")


class HfImportError(ValueError):
    """A Hugging Face directory that cannot be imported, and why."""


@dataclass(frozen=True)
class HfDir:
    """What a Hugging Face directory holds, once read and checked (:func:`read_hf_dir`)."""

    root: Path
    #: Weight files, in the order the index names them (one file without an index).
    weights: tuple[str, ...]
    index: str | None
    #: Config and tokenizer files to copy beside the weights.
    model_files: tuple[str, ...]
    #: Where the chat template comes from (a file name), or None: chat requests would fail.
    chat_template: str | None
    #: The config's ``tie_word_embeddings`` (None: unset, the model class's default applies).
    tied_embeddings: bool | None
    #: Entries not copied (documentation, pickles beside safetensors, subdirectories).
    left_out: tuple[str, ...]
    #: sha256 of every file to copy, checked against the hashes the directory carries.
    sha256: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.model_files, *((self.index,) if self.index else ()), *self.weights)


def read_hf_dir(src: Path, progress: Progress = SILENT) -> HfDir:
    """Read ``src`` and check it whole (module docstring); raises :class:`HfImportError`.
    ``progress`` counts the bytes hashed (every file to copy is hashed here)."""
    src = Path(src)
    if not src.is_dir():
        raise HfImportError(f"{src}: no such directory" if not src.exists() else f"{src} is not a directory")
    names = sorted(p.name for p in src.iterdir() if p.is_file())
    if "config.json" not in names:
        raise HfImportError(f"{src} has no config.json: not a Hugging Face model directory")
    config = _json(src / "config.json")
    weights, index = _weights(src, names)
    if not any(n in names for n in TOKENIZER_VOCAB):
        raise HfImportError(f"{src} has no tokenizer: none of {', '.join(TOKENIZER_VOCAB)}; serving and the "
                            "trainer tokenize with the model's own tokenizer, so copy its tokenizer files in")
    model_files = tuple(n for n in MODEL_FILES if n in names)
    copied = {*model_files, *weights, *((index,) if index else ())}
    left_out = tuple(sorted(p.name + ("/" if p.is_dir() else "") for p in src.iterdir()
                            if p.name not in copied and p.name != MANIFEST_NAME))
    hf = HfDir(src, weights, index, model_files, _chat_template(src, names), _tied(config), left_out)
    return replace(hf, sha256=_verified_hashes(src, hf.files, progress))


def import_hf_dir(src: Path, out: Path, *, check: Callable[[Path], None] | None = None,
                  progress: Progress = SILENT) -> HfDir:
    """Copy ``src``'s model into the new directory ``out``, run ``check(out)`` (the caller's: can
    serving and the trainer load it? raise to refuse), then write the manifest (version 0).
    ``progress`` is told each pass over the bytes: hashing the source, copying, hashing the copy.

    Nothing is left in ``out`` when a check fails: a half-imported directory has no manifest and
    serving would refuse it anyway, but an empty one can be imported into again.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HfImportError(f"{out} is not empty; import into a new directory")
    hf = read_hf_dir(src, progress)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with progress.task(f"copy to {out.name}", sum((hf.root / n).stat().st_size for n in hf.files)) as task:
            for name in hf.files:
                copy_file(hf.root / name, out / name, task.advance)  # a cache's symlink: the bytes it names
        if check is not None:
            check(out)
        # built from the copies: a file that changed between hashing and copying is caught here
        man = manifest.build(out, version=0, parent=None, extra={"step": 0, "imported_from": _provenance(hf)},
                             progress=progress)
        changed = sorted(n for n in hf.files if man["files"][n]["sha256"] != hf.sha256[n])
        if changed:
            raise HfImportError(f"{src}: {changed} changed while being imported; import again")
        manifest.write(out, man)  # last: without it, serving refuses the directory
    except BaseException:
        _clear(out, created)
        raise
    return hf


# -- weights -------------------------------------------------------------------------------------
def _weights(src: Path, names: list[str]) -> tuple[tuple[str, ...], str | None]:
    """The weight files a loader reads, and the index naming them, after checking every one."""
    safetensors = [n for n in names if n.endswith(".safetensors")]
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if not safetensors and not indexes:
        pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise HfImportError(
                f"{src} has weights only as pickle files ({', '.join(pickles)}): Flywheel loads safetensors only, "
                "because unpickling runs code. Convert them first, e.g. load the model with transformers and "
                "save_pretrained(dir, safe_serialization=True) on a machine you trust")
        raise HfImportError(f"{src} holds no *.safetensors weights")
    if len(indexes) > 1:
        raise HfImportError(f"{src} has several weight indexes ({', '.join(indexes)}); keep the one the model uses")
    if not indexes:
        if safetensors != ["model.safetensors"]:
            raise HfImportError(f"{src}: {', '.join(safetensors)} without a model.safetensors.index.json; "
                                "one file must be named model.safetensors, several need their index")
        _tensors(src / "model.safetensors")
        return ("model.safetensors",), None
    return _sharded(src, indexes[0], safetensors), indexes[0]


def _sharded(src: Path, index: str, present: list[str]) -> tuple[str, ...]:
    weight_map = _json(src / index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise HfImportError(f"{src / index} has no weight_map of tensor names to shard files")
    shards = tuple(sorted(set(weight_map.values())))
    for shard in shards:
        if "/" in shard or "\\" in shard or not shard.endswith(".safetensors"):
            raise HfImportError(f"{src / index} names {shard!r}: not a .safetensors file beside it")
        if shard not in present:
            raise HfImportError(f"{src / index} names the shard {shard}, which is missing from {src}")
    unnamed = sorted(set(present) - set(shards))
    if unnamed:
        # vLLM loads every *.safetensors it finds beside an index it does not filter by; a stray
        # consolidated copy would be loaded twice or instead of the shards
        raise HfImportError(f"{src}: {', '.join(unnamed)} not named by {index}; remove it or the index")
    seen: dict[str, str] = {}
    for shard in shards:
        held = _tensors(src / shard)
        for name in held:
            if name in seen:
                raise HfImportError(f"{src}: tensor {name} is in both {seen[name]} and {shard}")
            seen[name] = shard
        said = {n for n, s in weight_map.items() if s == shard}
        if held != said:
            diff = sorted(said - held)[:3] or sorted(held - said)[:3]
            raise HfImportError(f"{src}: {shard} does not hold the tensors {index} names for it (first differing: "
                                f"{', '.join(diff)})")
    return shards


def _tensors(path: Path) -> set[str]:
    """The tensor names of a safetensors file, after checking its header against its size."""
    try:
        header, base = manifest.safetensors_header(path)
        metas = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(m["data_offsets"][1]) for m in metas.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise HfImportError(f"{path} is not a valid safetensors file ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    if base + end != size:
        raise HfImportError(f"{path} is {size} bytes, its header describes {base + end}: truncated or altered")
    return set(metas)


# -- tokenizer, config ---------------------------------------------------------------------------
def _chat_template(src: Path, names: list[str]) -> str | None:
    for name in ("chat_template.jinja", "chat_template.json"):
        if name in names:
            return name
    if "tokenizer_config.json" in names and _json(src / "tokenizer_config.json").get("chat_template"):
        return "tokenizer_config.json"
    return None


def _tied(config: dict[str, Any]) -> bool | None:
    # a composite config (text and vision) keeps it on its text part
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return None if tied is None else bool(tied)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HfImportError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HfImportError(f"{path} is not a JSON object")
    return value


# -- hashes --------------------------------------------------------------------------------------
def _verified_hashes(src: Path, files: tuple[str, ...], progress: Progress = SILENT) -> dict[str, str]:
    """sha256 of each file, after checking every hash ``src`` carries for it."""
    if (src / MANIFEST_NAME).is_file():
        try:
            manifest.verify_dir(src, progress=progress)  # a directory Flywheel wrote (an export): every byte it lists
        except ManifestError as exc:
            raise HfImportError(f"{src} fails its own {MANIFEST_NAME}: {exc}") from None
    out = {}
    with progress.task(f"hash {src.name}", sum((src / n).stat().st_size for n in files)) as task:
        for name in files:
            path = src / name
            sha256, sha1 = _digests(path, task.advance)
            for kind, want, where in _published_hashes(src, name):
                got = sha256 if kind == "sha256" else sha1
                if got != want:
                    raise HfImportError(f"{path}: hash mismatch with {where} ({kind} {got[:12]}…, "
                                        f"expected {want[:12]}…)")
            out[name] = sha256
    return out


def _digests(path: Path, advance: Callable[[int], None] | None = None) -> tuple[str, str]:
    """sha256 of the bytes, and git's blob sha1 (how the hub names small files)."""
    size = path.stat().st_size
    h256, h1 = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h256.update(block)
            h1.update(block)
            if advance is not None:
                advance(len(block))
    return h256.hexdigest(), h1.hexdigest()


def _published_hashes(src: Path, name: str) -> list[tuple[str, str, str]]:
    """``(sha256|sha1, hex, where)`` for each hash the directory carries for ``name``.

    A hub cache snapshot links each file to a blob named by its hash (sha256 for LFS files, git's
    sha1 otherwise); ``huggingface-cli download --local-dir`` records the same as an ETag in
    ``.cache/huggingface/download/<name>.metadata`` (commit, ETag, time), which it ignores once
    the file is newer than the record, and so does this.
    """
    found = []
    path = src / name
    if path.is_symlink():
        blob = path.resolve().name
        if _HEX64.fullmatch(blob) or _HEX40.fullmatch(blob):
            found.append(("sha256" if len(blob) == 64 else "sha1", blob, f"its cache blob name {blob[:12]}…"))
    meta = src / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    if meta.is_file():
        lines = meta.read_text().splitlines()
        etag = lines[1].strip().strip('"') if len(lines) > 1 else ""
        try:
            fresh = len(lines) > 2 and path.stat().st_mtime - 1 <= float(lines[2])
        except ValueError:
            fresh = False
        if fresh and (_HEX64.fullmatch(etag) or _HEX40.fullmatch(etag)):
            found.append(("sha256" if len(etag) == 64 else "sha1", etag, "the ETag its download recorded"))
    return found


def _provenance(hf: HfDir) -> dict[str, Any]:
    return {"directory": hf.root.name, "weights": list(hf.weights), "tied_embeddings": hf.tied_embeddings,
            "chat_template": hf.chat_template}


def _clear(out: Path, created: bool) -> None:
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
