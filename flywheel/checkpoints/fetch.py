"""Fetching a published version into a reader's own local cache, never writing to the store.

Serving (and any tool) that must load version N calls :func:`fetch_version` with where the
release said N lives (a directory or an fsspec URL: ``s3://``, ``gs://``, ``file://``) and the
sha256 its checkpoint event announced for N's manifest:

1. **fetch**: the manifest is read and hashed first (a different manifest is refused before a
   byte of weights is copied), then every file it lists is copied into ``<cache>/.tmp-*``.
   A version whose full weights were pruned keeps a delta from its parent: the parent is fetched
   the same way from beside it (its own manifest need not be announced, because the child's final
   hash check covers every byte it contributes). An adapter version (manifest.py) is fetched the
   same way, its ``adapter_model.safetensors`` pruned and rebuilt like a full version's weights;
   the base it names is the reader's to check (:func:`~flywheel.checkpoints.manifest.verify_base`). Weights in several files (the shards of an
   imported model) are files of the manifest like any other: each is copied and checked; only
   the trainer's single ``model.safetensors`` is ever pruned to a delta (the store's docstring
   says why versions are consolidated).
2. **rebuild**: deltas applied forward from the nearest full weights, each delta file and each
   intermediate result checked against its manifest (:meth:`CheckpointStore.materialize_bytes`).
3. **verify**: every file and every tensor against the manifest, and the manifest against the
   announced hash.

Anything that fails 1-3 raises :class:`VersionRefused` with a short ``reason`` (``absent``,
``manifest_mismatch``, ``malformed``, ``verification_failed``) and leaves nothing of that version
in the cache. A store that cannot be reached raises :class:`StoreUnreachable`: the caller retries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.checkpoints import manifest
from flywheel.checkpoints.delta import DeltaError
from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError
from flywheel.checkpoints.store import (
    DELTA,
    CheckpointStore,
    pruned,
    verify_tensors,
    vname,
)

log = logging.getLogger(__name__)

#: Every ``reason`` a :class:`VersionRefused` gives.
REFUSAL_REASONS = ("absent", "manifest_mismatch", "malformed", "verification_failed")


class VersionRefused(ValueError):
    """A version that must not be served. ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, version: int, reason: str, detail: str) -> None:
        super().__init__(f"version {version} refused ({reason}): {detail}")
        self.version, self.reason, self.detail = version, reason, detail


class StoreUnreachable(OSError):
    """The store did not answer (network, permissions, a missing mount): worth trying again."""


@dataclass
class Fetched:
    """A verified, loadable model directory in the cache, and seconds spent per phase."""

    path: Path
    manifest: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=lambda: {"fetch": 0.0, "rebuild": 0.0, "verify": 0.0})


def fetch_version(uri: str, version: int, manifest_sha256: str | None, cache: CheckpointStore) -> Fetched:
    """``version`` from the store at ``uri`` into ``cache``, rebuilt and verified (module docstring)."""
    out = Fetched(cache.path(version), {})
    held = cache.path(version)
    if held.is_dir() and manifest_sha256 is not None and manifest.sha256_file(held / MANIFEST_NAME) != manifest_sha256:
        shutil.rmtree(held)  # the cache holds some other bytes under this number: never trust them
    if not held.is_dir():
        t0 = time.perf_counter()
        _copy_chain(uri, version, manifest_sha256, cache, out)
        out.seconds["fetch"] += time.perf_counter() - t0
    try:
        out.manifest = _rebuild_and_verify(cache, version, manifest_sha256, out.seconds)
    except (ManifestError, DeltaError, OSError) as exc:
        _drop(cache, version)
        raise VersionRefused(version, "verification_failed", str(exc)) from None
    return out


def prune_cache(cache: CheckpointStore, keep: set[int]) -> None:
    """Delete every cached version but ``keep`` (the versions loaded now)."""
    for v in cache.versions():
        if v not in keep:
            _drop(cache, v)
    for p in cache.root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    cache.drop_stale_rebuilds()


# -- the three phases -----------------------------------------------------------------------------
def _copy_chain(uri: str, version: int, want_sha: str | None, cache: CheckpointStore, out: Fetched) -> None:
    fs, base = _open(uri, version)
    raw = _read_manifest(fs, base, uri, version)
    got = hashlib.sha256(raw).hexdigest()
    if want_sha is not None and got != want_sha:
        raise VersionRefused(version, "manifest_mismatch",
                             f"the manifest at {uri} hashes to {got[:12]}…, the release announced {want_sha[:12]}…")
    man = _parse_manifest(raw, version)
    tmp = cache.root / f".tmp-fetch-{vname(version)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        (tmp / MANIFEST_NAME).write_bytes(raw)
        for name in man["files"]:
            try:
                fs.get_file(f"{base}/{name}", str(tmp / name))
            except FileNotFoundError:
                if name == manifest.weights_name(man) and DELTA in man["files"]:
                    continue  # pruned: rebuilt from the parent below (no other file ever is)
                raise VersionRefused(version, "absent", f"{name}, listed in its manifest, is missing at {uri}") from None
            except OSError as exc:
                raise StoreUnreachable(f"copying {name} of version {version} from {uri}: {exc}") from exc
        if pruned(tmp, man):
            parent = man.get("parent")
            if not isinstance(parent, int) or parent < 0 or parent >= version:
                raise VersionRefused(version, "malformed", f"its weights are a delta from an invalid parent {parent!r}")
            if not cache.path(parent).is_dir():
                _copy_chain(_sibling(uri, parent), parent, None, cache, out)
        if cache.path(version).exists():
            shutil.rmtree(cache.path(version))
        os.rename(tmp, cache.path(version))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rebuild_and_verify(cache: CheckpointStore, version: int, want_sha: str | None,
                        seconds: dict[str, float]) -> dict[str, Any]:
    d = cache.path(version)
    t0 = time.perf_counter()
    if pruned(d, manifest.read(d)):
        cache.place_weights(version, cache.materialize_bytes(version))  # every delta and intermediate checked
    t1 = time.perf_counter()
    man = manifest.verify_dir(d, expect_manifest_sha256=want_sha)
    verify_tensors(d, man)
    if man.get("version") != version:
        raise ManifestError(f"the manifest describes version {man.get('version')!r}, not {version}")
    seconds["rebuild"] += t1 - t0
    seconds["verify"] += time.perf_counter() - t1
    return man


# -- helpers --------------------------------------------------------------------------------------
def _open(uri: str, version: int) -> tuple[Any, str]:
    import fsspec

    try:
        fs, base = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or its package is missing
        raise VersionRefused(version, "malformed", f"cannot open store URI {uri!r}: {exc}") from None
    return fs, base.rstrip("/")


def _read_manifest(fs: Any, base: str, uri: str, version: int) -> bytes:
    try:
        return fs.cat_file(f"{base}/{MANIFEST_NAME}")
    except FileNotFoundError:
        raise VersionRefused(version, "absent", f"no {MANIFEST_NAME} at {uri}: not in the store") from None
    except NotADirectoryError:
        raise VersionRefused(version, "absent", f"{uri} is not a version directory") from None
    except OSError as exc:
        raise StoreUnreachable(f"reading the manifest of version {version} at {uri}: {exc}") from exc


def _parse_manifest(raw: bytes, version: int) -> dict[str, Any]:
    try:
        man = json.loads(raw)
    except ValueError as exc:
        raise VersionRefused(version, "malformed", f"its manifest is not JSON: {exc}") from None
    files = man.get("files") if isinstance(man, dict) else None
    if not isinstance(files, dict) or man.get("format") != manifest.FORMAT:
        raise VersionRefused(version, "malformed", "its manifest has no file list in the expected format")
    for name in files:
        # names come from the store: a path outside the version directory is never fetched
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith(".tmp"):
            raise VersionRefused(version, "malformed", f"its manifest lists an unsafe file name {name!r}")
    if man.get("version") != version:
        raise VersionRefused(version, "malformed", f"its manifest describes version {man.get('version')!r}")
    return man


def _sibling(uri: str, version: int) -> str:
    return f"{uri.rstrip('/').rsplit('/', 1)[0]}/{vname(version)}"


def _drop(cache: CheckpointStore, version: int) -> None:
    shutil.rmtree(cache.path(version), ignore_errors=True)
