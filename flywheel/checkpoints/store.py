"""The checkpoint store: published versions, their deltas and ledgers, and chain reconstruction.

Layout under the store root (``<data_dir>/checkpoints`` by default)::

    v00000003/
      config.json, tokenizer files   copied from the model directory (HF layout: vLLM loads it)
      model.safetensors              weights in the served dtype (pruned on old non-snapshot versions)
      delta.fwd                      lossless delta from the parent's model.safetensors (delta.py)
      ledger.json                    generation ids trained in this version, drops by reason
      flywheel-manifest.json         version, parent, step, samples, hashes, metrics, data offsets
      ds/                            DeepSpeed checkpoint (optimizer state), newest few versions only

An adapter version (LoRA training, ``trainer.lora_rank`` > 0) holds ``adapter_config.json`` and
``adapter_model.safetensors`` instead of a model's config, tokenizer and weights: a PEFT adapter
directory, which vLLM's LoRA support loads as it is. The rest is the same: ``delta.fwd`` from the
parent's adapter file (pruned the same way), the ledger, the manifest (its ``adapter`` entry names
the base model and the sha256 of the base's manifest: manifest.py), ``ds/`` (the adapter's
parameters and optimizer state only). A chain never mixes kinds or bases: a version whose parent
is of another kind or on another base is a full snapshot of its own kind.

Every published version holds its weights as one file, ``model.safetensors``, also when the model
it started from is sharded (``model-0000N-of-0000M.safetensors`` with an index, as ``flywheel model
import`` keeps a Hugging Face directory). The consolidation is deliberate: the trainer holds every
parameter on each rank (ZeRO 0-2) and writes them in one ``save_file``; a delta is then one
container with one parent hash, a chain is one file per version, and serving rebuilds a version
into one buffer. Shards exist to split uploads and downloads on a hub, which the store does not
need; what they would buy here (rebuilding one shard at a time in less memory) is left for
models whose weights do not fit a reader's memory. The source's shard files and its index are
never copied beside the consolidated file: vLLM filters the weight files by an index it finds, so
a stale index would hide ``model.safetensors`` from it.

A version becomes visible in one atomic step: everything is written into ``.tmp-*`` beside it,
fsynced, then renamed to ``vNNNNNNNN`` and the root directory fsynced. A directory without that
name does not exist as far as readers and restarts are concerned, so a kill -9 at any moment leaves
either the old latest version or the new one, never half of one.

``flywheel checkpoint verify|reconstruct`` and serving use :func:`CheckpointStore.materialize`:
walk the parent chain back to the nearest version that still holds full weights, apply deltas
forward, and check every delta file, every tensor and the final file against the manifests.

The trainer's rank 0 is the only writer (:meth:`CheckpointStore.staging_dir`, then
:meth:`CheckpointStore.commit`); :func:`open_store` opens the store a deployment's settings name,
for the trainer and for readers alike.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.checkpoints import delta as deltas
from flywheel.checkpoints import manifest
from flywheel.checkpoints.manifest import ManifestError
from flywheel.durable import fsync_dir, fsync_tree
from flywheel.progress import SILENT, Progress

if TYPE_CHECKING:
    from flywheel.checkpoints.remote import ObjectStore
    from flywheel.settings import Settings

log = logging.getLogger(__name__)

WEIGHTS = manifest.WEIGHTS
ADAPTER_WEIGHTS = manifest.ADAPTER_WEIGHTS
DELTA = "delta.fwd"
LEDGER = "ledger.json"
DS_DIR = "ds"
REBUILD_PREFIX = ".rebuild-"
#: Copied from the source model directory by every name but these (the weights are the trainer's).
_SKIP_COPY = {manifest.MANIFEST_NAME}
_SKIP_SUFFIXES = (".safetensors", ".safetensors.index.json")
#: An OSError's errno that says the store is out of reach for now, not broken: a mode taken away
#: (EACCES, EPERM), a network filesystem that does not answer (EIO, ESTALE, ETIMEDOUT and the
#: connection errors), a full disk or quota. The trainer waits these out and publishes once the
#: store answers (docs/trainer.md, "When the checkpoint store is out of reach"); anything else (a
#: version without its manifest, a hash that does not match) is a broken store, and fails.
OUT_OF_REACH = frozenset({
    errno.EACCES, errno.EPERM, errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR,
    errno.ENOTCONN, errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTDOWN,
    errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
})


def vname(version: int) -> str:
    return f"v{version:08d}"


class CheckpointStore:
    """Versions under one local root. Writers: the trainer's rank 0. Readers: anyone."""

    def __init__(self, root: Path, *, full_every: int = 10, keep_full: int = 3, keep_optimizer: int = 2) -> None:
        self.root = Path(root)
        self.full_every = full_every
        self.keep_full = keep_full
        self.keep_optimizer = keep_optimizer
        #: a version was renamed into the root, but the root's fsync failed (:meth:`sync`)
        self.unsynced = False
        #: the object store versions are published to and pulled from (remote.py), if any
        self.remote: ObjectStore | None = None
        self.root.mkdir(parents=True, exist_ok=True)

    def out_of_reach(self, exc: BaseException) -> OSError | None:
        """The error saying the store is out of reach for now, if that is why ``exc`` was raised:
        ``exc`` itself when it is such an OSError (:data:`OUT_OF_REACH`), else what listing the root
        raises now, since a library that wraps the OSError (DeepSpeed's save, torch's file writer)
        no longer says the cause. None while the store answers: ``exc`` is something else."""
        if isinstance(exc, OSError) and exc.errno in OUT_OF_REACH:
            return exc
        if self.remote is not None:  # an object store's client raises its own errors
            from flywheel.checkpoints.remote import unreachable

            if (err := unreachable(exc)) is not None:
                return err
        try:
            os.listdir(self.root)
        except OSError as probe:
            return probe if probe.errno in OUT_OF_REACH else None
        return None

    # ------------------------------------------------------------ reading
    def versions(self) -> list[int]:
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
        return sorted(out)

    def latest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def path(self, version: int) -> Path:
        return self.root / vname(version)

    def manifest(self, version: int) -> dict[str, Any]:
        return manifest.read(self.path(version))

    def ledger(self, version: int) -> dict[str, Any]:
        return json.loads((self.path(version) / LEDGER).read_text())

    # ------------------------------------------------------------ writing
    def staging_dir(self, version: int) -> Path:
        """A fresh temp dir for ``version``; invisible to readers until :meth:`commit`."""
        tmp = self.root / f".tmp-{vname(version)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def is_snapshot(self, version: int, parent: int | None) -> bool:
        return parent is None or version % self.full_every == 0

    def commit(
        self,
        tmp: Path,
        *,
        version: int,
        parent: int | None,
        source_dir: Path,
        extra: dict[str, Any],
        ledger: dict[str, Any],
        adapter: manifest.Adapter | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Finish a staged version (``tmp`` already holds model.safetensors, or for an ``adapter``
        adapter_model.safetensors and adapter_config.json) and publish it.

        Returns ``(manifest sha256, manifest)``.
        """
        name = ADAPTER_WEIGHTS if adapter is not None else WEIGHTS
        weights = sorted(p.name for p in tmp.iterdir() if p.name.endswith(_SKIP_SUFFIXES))
        if weights != [name]:
            raise ManifestError(f"a staged version holds its weights as one {name} (module docstring), "
                                f"{tmp.name} holds {weights or 'none'}")
        if adapter is None:
            _copy_model_files(source_dir, tmp)
        elif not (tmp / manifest.ADAPTER_CONFIG).is_file():
            raise ManifestError(f"a staged adapter version needs its {manifest.ADAPTER_CONFIG}")
        full = self.is_snapshot(version, parent) or not self._same_kind(parent, adapter)
        info: dict[str, Any] = {"full_snapshot": full}
        if adapter is not None:
            info["adapter"] = adapter.to_json()
        if not full:
            parent_bytes = self.materialize_bytes(parent)
            child = (tmp / name).read_bytes()
            blob = deltas.make_delta(parent_bytes, child, parent_version=parent)
            (tmp / DELTA).write_bytes(blob)
            info.update(delta_bytes=len(blob), weight_bytes=len(child), delta_ratio=len(child) / max(1, len(blob)))
        (tmp / LEDGER).write_text(json.dumps(ledger, sort_keys=True))
        man = manifest.build(tmp, version=version, parent=parent, extra={**extra, **info})
        sha = manifest.write(tmp, man)
        fsync_tree(tmp)
        final = self.path(version)
        if final.exists():
            raise ManifestError(f"version {version} already exists in {self.root}")
        os.rename(tmp, final)
        # The rename is the commit: the version is published whatever happens next, so a failure
        # to fsync the root or to prune must not make the caller publish it again. sync() retries
        # the fsync, and the writer calls it before announcing the version; the next commit prunes.
        self.unsynced = True
        try:
            self.sync()
            self.prune()
        except OSError as exc:
            log.warning("version %d is published, but %s; the root's fsync and pruning are tried again", version, exc)
        return sha, man

    def sync(self) -> None:
        """fsync the root if a commit could not (raises the OSError while it still cannot): until
        then a power loss may undo the newest rename, so a version is announced after this."""
        if self.unsynced:
            fsync_dir(self.root)
            self.unsynced = False

    def _same_kind(self, parent: int | None, adapter: manifest.Adapter | None) -> bool:
        """Whether a delta from ``parent`` can hold the new version: both full, or adapters of
        one shape on one base (a delta between others would not even share a layout)."""
        if parent is None:
            return False
        theirs = manifest.adapter_of(self.manifest(parent))
        if adapter is None or theirs is None:
            return adapter is None and theirs is None
        return (theirs.base_manifest_sha256, theirs.rank, theirs.target_modules) == \
            (adapter.base_manifest_sha256, adapter.rank, adapter.target_modules)

    def prune(self) -> None:
        """Drop full weights of old non-snapshot versions and old optimizer states (never the chain)."""
        versions = self.versions()
        for v in versions[: -self.keep_full]:
            p = self.path(v)
            if (p / DELTA).exists():
                (p / manifest.weights_name(self.manifest(v))).unlink(missing_ok=True)
        for v in versions[: -self.keep_optimizer]:
            shutil.rmtree(self.path(v) / DS_DIR, ignore_errors=True)
        for p in self.root.glob(".tmp-*"):
            if p.is_dir():  # left by a crashed publish: never visible, safe to delete
                shutil.rmtree(p, ignore_errors=True)
        self.drop_stale_rebuilds()

    # ------------------------------------------------------------ reconstruction
    def materialize_bytes(self, version: int, progress: Progress = SILENT) -> bytes:
        """The verified weights file of ``version``, rebuilt from its chain when pruned.

        ``progress`` counts the bytes read and hashed of the base, then of each version rebuilt
        (applied, then hashed): one step of known size, since every manifest gives its file's."""
        name = manifest.weights_name(self.manifest(version))  # a chain holds one kind (commit)
        chain = [version]
        while not (self.path(chain[-1]) / name).exists():
            man = self.manifest(chain[-1])
            if man.get("parent") is None:
                raise ManifestError(f"version {chain[-1]} has neither weights nor a parent to rebuild from")
            chain.append(man["parent"])
        base = chain.pop()
        label = f"rebuild v{version} from v{base} + {len(chain)} deltas" if chain else f"read v{version}"
        # read and hash the base, then apply and hash each version after it
        total = 2 * ((self.path(base) / name).stat().st_size + sum(_size(self.manifest(v), name) for v in chain))
        with progress.task(label, total) as task:
            data = _read_checked(self.path(base) / name, self.manifest(base), base, task.advance)
            for v in reversed(chain):
                man = self.manifest(v)
                blob = (self.path(v) / DELTA).read_bytes()
                _check_file(man, DELTA, blob, v)
                try:
                    data = deltas.apply_delta(data, blob, check_parent=False)  # parent verified above
                except deltas.DeltaError as exc:
                    raise ManifestError(f"version {v}: delta does not apply: {exc}") from None
                task.advance(len(data))
                _check_file(man, name, data, v, task.advance)
        return data

    def materialize(self, version: int, progress: Progress = SILENT) -> Path:
        """Restore ``version``'s model.safetensors in place if pruned; verify every file; return the dir."""
        d = self.path(version)
        if pruned(d, self.manifest(version)):
            self.place_weights(version, self.materialize_bytes(version, progress))
        man = manifest.verify_dir(d, allow_dirs={DS_DIR}, progress=progress)
        verify_tensors(d, man, progress)
        return d

    def place_weights(self, version: int, data: bytes) -> None:
        """Put rebuilt weights into ``version``'s directory in one rename.

        The partial file is written beside the versions, not inside one: there a concurrent
        reader's :func:`~flywheel.checkpoints.manifest.verify_dir` would meet a file no manifest
        lists, and a crash would leave one that fails every later check. Not under ``.tmp-*``,
        which the trainer's :meth:`prune` deletes while a reader may still be writing.
        """
        part = self.root / f"{REBUILD_PREFIX}{vname(version)}-{uuid.uuid4().hex[:8]}"
        try:
            part.write_bytes(data)
            os.replace(part, self.path(version) / manifest.weights_name(self.manifest(version)))
        finally:
            part.unlink(missing_ok=True)

    def drop_stale_rebuilds(self, older_than_s: float = 3600.0) -> None:
        """Delete partial rebuilds a crash left behind (a live one takes seconds, not an hour)."""
        now = time.time()
        for p in self.root.glob(f"{REBUILD_PREFIX}*"):
            with contextlib.suppress(OSError):  # another reader's, finished and renamed meanwhile
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink()

    def export(self, version: int, out: Path, progress: Progress = SILENT) -> Path:
        """Copy a verified, loadable HF directory of ``version`` to ``out`` (no optimizer state)."""
        src = self.materialize(version, progress)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        files = [p for p in src.iterdir() if p.is_file()]  # never ds/: the optimizer state is the trainer's own
        with progress.task(f"copy to {out.name}", sum(p.stat().st_size for p in files)) as task:
            for p in files:
                copy_file(p, out / p.name, task.advance)
                shutil.copystat(p, out / p.name)  # as copy2 did
        manifest.verify_dir(out, progress=progress)
        return out


def store_root(settings: Settings) -> Path:
    """Where the local store ``settings`` name lives: the trainer's ``store`` when it is a
    directory, else ``<data_dir>/checkpoints`` (with an object store's URL there, the trainer's
    working copy: remote.py). A reader that must not create it (``flywheel usage``) checks it exists first."""
    cfg = settings.trainer
    return Path(cfg.store) if cfg.store and "://" not in cfg.store else settings.data_dir / "checkpoints"


def open_store(settings: Settings) -> CheckpointStore:
    """The local store ``settings`` name (:func:`store_root`), created if missing, with the object
    store it publishes to when ``trainer.store`` is a URL (remote.py)."""
    from flywheel.checkpoints.remote import ObjectStore, is_url

    cfg = settings.trainer
    store = CheckpointStore(store_root(settings), full_every=cfg.full_every, keep_full=cfg.keep_full,
                            keep_optimizer=cfg.keep_optimizer)
    if cfg.store and is_url(cfg.store):
        store.remote = ObjectStore(cfg.store)
    return store


def pruned(directory: Path, man: dict[str, Any]) -> bool:
    """Whether a version's weights must be rebuilt from its delta chain: it keeps a delta and its
    weights file is gone. A version without a delta holds all its weights, one file or shards;
    a missing one is a missing file, not something to rebuild."""
    return DELTA in man["files"] and not (Path(directory) / manifest.weights_name(man)).exists()


def copy_file(src: Path, dst: Path, advance: Callable[[int], None], chunk: int = 8 << 20) -> None:
    """``shutil.copyfile`` in ``chunk``-byte blocks, ``advance(n)`` after each (progress): a
    multi-GB weights file is minutes on a network filesystem. A symlink is copied as the bytes
    it names, as copyfile does."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(chunk):
            fout.write(block)
            advance(len(block))


def _size(man: dict[str, Any], name: str) -> int:
    return int(man["files"].get(name, {}).get("bytes", 0))


def _read_checked(path: Path, man: dict[str, Any], version: int, advance: Callable[[int], None]) -> bytes:
    """A file's bytes, checked against ``man``: read whole (one buffer, as before: a multi-GB
    file read in blocks and joined would need twice its size), then hashed in blocks."""
    data = path.read_bytes()
    advance(len(data))
    _check_file(man, path.name, data, version, advance)
    return data


def _check_file(man: dict[str, Any], name: str, data: bytes, version: int,
                advance: Callable[[int], None] | None = None, chunk: int = 8 << 20) -> None:
    import hashlib

    want = man["files"].get(name, {}).get("sha256")
    h, view = hashlib.sha256(), memoryview(data)
    for i in range(0, len(view), chunk):  # in blocks, so a multi-GB hash shows it moves
        block = view[i:i + chunk]
        h.update(block)
        if advance is not None:
            advance(len(block))
    got = h.hexdigest()
    if want != got:
        raise ManifestError(
            f"version {version}: {name} fails hash verification (got {got[:12]}…, manifest {str(want)[:12]}…)"
        )


def verify_tensors(directory: Path, man: dict[str, Any], progress: Progress = SILENT) -> None:
    """Every tensor's sha256 against the manifest (catches a rewritten file with a fixed-up hash)."""
    got = manifest.tensor_hashes(directory, progress)
    if got != man["tensors"]:
        bad = sorted(k for k in set(got) | set(man["tensors"]) if got.get(k) != man["tensors"].get(k))
        raise ManifestError(f"{directory}: tensor hash mismatch for {bad[:5]}")


def _copy_model_files(source: Path, dest: Path) -> None:
    """Config, generation config and tokenizer files: everything serving needs besides weights."""
    for p in Path(source).iterdir():
        wanted = p.is_file() and p.name not in _SKIP_COPY and not p.name.endswith(_SKIP_SUFFIXES)
        if wanted and not (dest / p.name).exists():  # a file the trainer wrote itself wins
            shutil.copy2(p, dest / p.name)
