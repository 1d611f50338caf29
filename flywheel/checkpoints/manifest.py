"""Model-directory manifests: what a published version contains and the hashes that prove it.

A served model directory is a Hugging Face directory (``config.json``, tokenizer files,
``*.safetensors``: one file, or shards with their ``model.safetensors.index.json``, each a file of
the manifest like any other) plus ``flywheel-manifest.json``. The manifest lists the sha256 of every file and
of every tensor's raw bytes. Serving calls :func:`verify_dir` before it loads weights and refuses a
directory whose bytes do not match, or that holds a file the manifest does not list; the trainer
writes manifests when it publishes a version and the delta codec checks tensor hashes after
reconstructing a version from its chain.

A version the trainer published in LoRA mode (``trainer.lora_rank`` above 0) is an *adapter*
instead: PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` (the layout vLLM's LoRA
support and ``PeftModel.from_pretrained`` load), with the same manifest. Its ``adapter`` entry
names the base model the adapter applies to and the sha256 of that base's own manifest, so a
reader refuses an adapter on any other base (:func:`verify_base`); :func:`adapter_of` tells the
two kinds apart.

Tensor hashes are computed from the safetensors byte layout directly (8-byte header length, JSON
header, raw data), so they need neither torch nor a dtype numpy understands (bf16).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.progress import SILENT, Progress, Task

MANIFEST_NAME = "flywheel-manifest.json"
FORMAT = "flywheel-manifest/1"


#: A full version's weights (the store consolidates them into this one file) ...
WEIGHTS = "model.safetensors"
#: ... and an adapter version's, with its PEFT config beside them.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class ManifestError(ValueError):
    """A directory that is not exactly what its manifest says."""


@dataclass(frozen=True)
class Adapter:
    """What an adapter version's manifest says of it: the base it applies to and its shape."""

    base_name: str
    #: sha256 of the base model directory's ``flywheel-manifest.json``: the base's identity
    base_manifest_sha256: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"base_name": self.base_name, "base_manifest_sha256": self.base_manifest_sha256,
                "rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


def adapter_of(manifest: dict[str, Any]) -> Adapter | None:
    """The adapter a version's manifest describes; None for a full-weight version."""
    a = manifest.get("adapter")
    if a is None:
        return None
    try:
        return Adapter(str(a["base_name"]), str(a["base_manifest_sha256"]), int(a["rank"]), float(a["alpha"]),
                       tuple(a["target_modules"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"version {manifest.get('version')}: malformed adapter entry ({exc!r})") from None


def weights_name(manifest: dict[str, Any]) -> str:
    """The one weights file a store version keeps (and may prune to a delta)."""
    return ADAPTER_WEIGHTS if manifest.get("adapter") is not None else WEIGHTS


def verify_base(base_dir: Path, adapter: Adapter) -> dict[str, Any]:
    """Check that ``base_dir`` is the base ``adapter`` was trained on, every file against its
    manifest and that manifest against the hash the adapter's manifest recorded. Returns the
    base's manifest; raises :class:`ManifestError` naming both hashes otherwise."""
    base_dir = Path(base_dir)
    path = base_dir / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"the adapter needs base {adapter.base_name!r}; {base_dir} has no {MANIFEST_NAME} "
                            "to prove it is that base")
    got = sha256_file(path)
    if got != adapter.base_manifest_sha256:
        raise ManifestError(f"the adapter needs base {adapter.base_name!r} (manifest "
                            f"{adapter.base_manifest_sha256[:12]}…); {base_dir} is another model (manifest {got[:12]}…)")
    return verify_dir(base_dir, expect_manifest_sha256=adapter.base_manifest_sha256)


def sha256_file(path: Path, chunk: int = 1 << 20, advance: Callable[[int], None] | None = None) -> str:
    """The file's sha256, read in ``chunk``-byte blocks; ``advance(n)`` after each (progress)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if advance is not None:
                advance(len(block))
    return h.hexdigest()


def _files_task(progress: Progress, label: str, paths: list[Path]) -> Task:
    return progress.task(label, sum(p.stat().st_size for p in paths))


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def iter_tensor_bytes(path: Path) -> Iterator[tuple[str, str, list[int], bytes]]:
    """Yield ``(name, dtype, shape, raw bytes)`` for each tensor in a safetensors file."""
    header, base = safetensors_header(path)
    with path.open("rb") as f:
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            f.seek(base + start)
            yield name, meta["dtype"], meta["shape"], f.read(end - start)


def tensor_hashes(directory: Path, progress: Progress = SILENT) -> dict[str, str]:
    """sha256 of every tensor in every ``*.safetensors`` file of ``directory`` (one file, or the
    shards of a sharded model), by tensor name. A name in two files is refused: which of the two
    a loader keeps is its own choice, so the hashes could not say what is served."""
    out: dict[str, str] = {}
    where: dict[str, str] = {}
    paths = sorted(directory.glob("*.safetensors"))
    data_bytes = sum(p.stat().st_size - safetensors_header(p)[1] for p in paths) if progress is not SILENT else 0
    with progress.task(f"hash tensors of {directory.name}", data_bytes) as task:
        for path in paths:
            for name, _dtype, _shape, raw in iter_tensor_bytes(path):
                if name in where:
                    raise ManifestError(f"{directory}: tensor {name} is in both {where[name]} and {path.name}")
                where[name] = path.name
                out[name] = hashlib.sha256(raw).hexdigest()
                task.advance(len(raw))
    return out


def build(directory: Path, *, version: int, parent: int | None, extra: dict[str, Any] | None = None,
          progress: Progress = SILENT) -> dict[str, Any]:
    """Describe ``directory`` as it is now (every file except the manifest itself)."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST_NAME]
    with _files_task(progress, f"hash files of {directory.name}", paths) as task:
        files = {p.name: {"sha256": sha256_file(p, advance=task.advance), "bytes": p.stat().st_size} for p in paths}
    if not any(name.endswith(".safetensors") for name in files):
        raise ManifestError(f"{directory} holds no .safetensors weights")
    dtypes = {
        meta["dtype"]
        for p in directory.glob("*.safetensors")
        for name, meta in safetensors_header(p)[0].items()
        if name != "__metadata__"
    }
    return {
        "format": FORMAT,
        "version": version,
        "parent": parent,
        "dtype": ",".join(sorted(dtypes)),
        "created_at": time.time(),
        "files": files,
        "tensors": tensor_hashes(directory, progress),
        **(extra or {}),
    }


def write(directory: Path, manifest: dict[str, Any]) -> str:
    """Write the manifest atomically; return its sha256 (what announcements carry)."""
    path = directory / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(path)
    return sha256_file(path)


def read(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{directory} has no {MANIFEST_NAME}; refusing unverified weights") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify_dir(directory: Path, expect_manifest_sha256: str | None = None, *,
               allow_dirs: frozenset[str] | set[str] = frozenset(), progress: Progress = SILENT) -> dict[str, Any]:
    """Check every file against the manifest (and the manifest against an announced hash).

    Every entry of ``directory`` must be the manifest or a file it lists: loaders read more than
    weights (``config.json`` can name remote code, a ``*.bin`` beside no safetensors is unpickled,
    a tokenizer or chat template changes what is generated), so nothing no hash covers may sit
    beside them. ``allow_dirs`` names subdirectories the caller owns and never serves (the store's
    optimizer state, ``ds/``). Returns the manifest. Raises :class:`ManifestError` naming the first
    mismatch.
    """
    directory = Path(directory)
    manifest = read(directory)
    unlisted = sorted(
        p.name for p in directory.iterdir()
        if p.name != MANIFEST_NAME and p.name not in manifest["files"] and not (p.is_dir() and p.name in allow_dirs)
    )
    if unlisted:
        raise ManifestError(f"{directory}: not in the manifest: {unlisted}; refusing files no hash covers")
    if expect_manifest_sha256 is not None:
        actual = sha256_file(directory / MANIFEST_NAME)
        if actual != expect_manifest_sha256:
            raise ManifestError(
                f"manifest of {directory} hashes to {actual[:12]}…, announced {expect_manifest_sha256[:12]}…"
            )
    for name in manifest["files"]:
        if not (directory / name).is_file():
            raise ManifestError(f"{directory}: file {name} listed in the manifest is missing")
    with _files_task(progress, f"verify files of {directory.name}", [directory / n for n in manifest["files"]]) as task:
        for name, meta in manifest["files"].items():
            actual = sha256_file(directory / name, advance=task.advance)
            if actual != meta["sha256"]:
                raise ManifestError(f"{directory}: {name} hash mismatch (got {actual[:12]}…, "
                                    f"manifest {meta['sha256'][:12]}…)")
    return manifest
