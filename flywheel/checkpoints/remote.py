"""A checkpoint store on an object store (``s3://bucket/prefix``, or any fsspec URL), with no
shared volume between the trainer and its readers.

``trainer.store = "s3://bucket/prefix"`` (the ``s3`` extra installs s3fs). The endpoint is the
standard ``AWS_ENDPOINT_URL`` (MinIO, Ceph and other S3-compatible stores), the credentials the
standard AWS variables or files: botocore reads both, so a pod is pointed at a store by its env
alone. The layout under the prefix is the local store's (store.py), one ``vNNNNNNNN/`` per version
with its ``ds/`` optimizer state, plus the ``announced`` mark (trainer/announce.py).

Who does what:

- the trainer keeps writing a local store (``<data_dir>/checkpoints``, an emptyDir is enough):
  DeepSpeed saves into a local directory and a delta is made from the parent's local weights.
  :meth:`ObjectStore.publish` uploads each committed version before it is announced, and the
  announcement names its URL. A start pulls the newest published version, optimizer state
  included, when the local store does not hold it (:meth:`ObjectStore.pull`), and resumes from it.
- the release controller and serving fetch the announced URL into a cache of their own
  (:func:`~flywheel.checkpoints.fetch.fetch_version`: every file and tensor checked against the
  manifest whose hash the announcement carries before anything is loaded).

**The publish rule.** S3 has no rename, so a version cannot appear in one step as a directory
does. Instead: every file of the version is uploaded first, its ``ds/`` included, and the manifest
last; **a version exists once its manifest exists**, and is used only once every file verifies
against that manifest (and the manifest against the announced hash). A publish cut short leaves
files without a manifest, which no reader lists or fetches, and the next publish of that number
overwrites them. A version number never gets a second content: publishing over a manifest with
other bytes is refused. Pruning removes, like the local store's, the full weights of old versions
that keep a delta (readers rebuild them from the chain) and old optimizer states.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from flywheel.checkpoints import manifest
from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError
from flywheel.checkpoints.store import DELTA, DS_DIR, LEDGER, CheckpointStore, vname

log = logging.getLogger(__name__)

MARK = "announced"


def is_url(store: str) -> bool:
    """Whether a ``trainer.store`` setting names an object store rather than a directory."""
    return "://" in store


def unreachable(exc: BaseException) -> OSError | None:
    """The error saying an object store does not answer for now, if that is why ``exc`` (or an
    error it was raised from) was raised: its endpoint refused or timed out, a connection cut, or
    access refused (s3fs raises PermissionError for a 403, as a local store's EACCES: a policy or
    key being fixed). The trainer waits these out as it does a local store's (trainer/outage.py);
    s3fs has retried each before raising it. None for anything else: a broken store fails."""
    denied: tuple[type[BaseException], ...] = (PermissionError,)
    away: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
    try:
        from aiohttp import ClientConnectionError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, NoCredentialsError

        denied += (NoCredentialsError,)
        away += (BotoConnectionError, HTTPClientError, ClientConnectionError)
    except ImportError:  # no s3 extra: no S3 client to raise them
        pass
    seen: BaseException | None = exc
    while seen is not None:
        for kinds, code in ((denied, errno.EACCES), (away, errno.EHOSTUNREACH)):
            if isinstance(seen, kinds):
                return OSError(code, f"the object store does not answer: {type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return None


def is_remote(uri: str) -> bool:
    """Whether an announced ``uri`` is on an object store a reader must fetch from; a path or a
    ``file://`` URL is a directory the reader may have mounted (a shared volume)."""
    return is_url(uri) and not uri.startswith(("file://", "local://"))


class ObjectStore:
    """Published versions under one fsspec URL (module docstring). Writer: the trainer's rank 0."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, base = fsspec.core.url_to_fs(self.url)
        self.base = base.rstrip("/")

    def uri(self, version: int) -> str:
        """Where ``version`` lives, as announcements name it."""
        return f"{self.url}/{vname(version)}"

    # ------------------------------------------------------------ reading
    def versions(self) -> list[int]:
        """Versions whose manifest exists (the publish rule), oldest first."""
        self.fs.invalidate_cache()  # s3fs caches listings: another process may have published since
        out = []
        for path in self.fs.glob(f"{self.base}/v*/{MANIFEST_NAME}"):
            name = path.rstrip("/").split("/")[-2]
            if name[1:].isdigit():
                out.append(int(name[1:]))
        return sorted(out)

    def latest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def manifest_bytes(self, version: int) -> bytes:
        return self.fs.cat_file(f"{self.base}/{vname(version)}/{MANIFEST_NAME}")

    def manifest(self, version: int) -> dict[str, Any]:
        return json.loads(self.manifest_bytes(version))

    def ledger(self, version: int) -> dict[str, Any]:
        return json.loads(self.fs.cat_file(f"{self.base}/{vname(version)}/{LEDGER}"))

    def pruned(self, version: int, man: dict[str, Any]) -> bool:
        """As store.py's :func:`~flywheel.checkpoints.store.pruned`: ``version`` keeps a delta and
        its weights object is gone (readers rebuild it from the chain)."""
        return DELTA in man["files"] and not self.fs.exists(f"{self.base}/{vname(version)}/{manifest.weights_name(man)}")

    def announced(self) -> int | None:
        """The announced mark kept beside the versions (None: never written)."""
        try:
            return int(self.fs.cat_file(f"{self.base}/{MARK}"))
        except FileNotFoundError:
            return None

    def mark_announced(self, version: int) -> None:
        self.fs.pipe_file(f"{self.base}/{MARK}", str(version).encode())

    # ------------------------------------------------------------ writing
    def publish(self, local_dir: Path) -> str:
        """Upload a committed local version (its files, ``ds/``, the manifest last) and return its
        URI. Publishing a version already there with the same manifest uploads nothing (a restart
        announces it again); one there with another manifest is refused."""
        local_dir = Path(local_dir)
        dest = f"{self.base}/{local_dir.name}"
        ours = (local_dir / MANIFEST_NAME).read_bytes()
        try:
            theirs = self.fs.cat_file(f"{dest}/{MANIFEST_NAME}")
        except FileNotFoundError:
            theirs = None
        if theirs == ours:
            return f"{self.url}/{local_dir.name}"
        if theirs is not None:
            raise ManifestError(f"{self.url}/{local_dir.name} is published with another manifest: a version "
                                "number never gets a second content")
        for p in sorted(local_dir.rglob("*")):
            if p.is_file() and p.name != MANIFEST_NAME:
                self.fs.put_file(str(p), f"{dest}/{p.relative_to(local_dir).as_posix()}")
        self.fs.put_file(str(local_dir / MANIFEST_NAME), f"{dest}/{MANIFEST_NAME}")  # the commit
        return f"{self.url}/{local_dir.name}"

    def prune(self, keep_full: int, keep_optimizer: int) -> None:
        """As the local store's prune: old full weights where a delta holds them, old ``ds/``."""
        versions = self.versions()
        for v in versions[:-keep_full]:
            man = self.manifest(v)
            weights = f"{self.base}/{vname(v)}/{manifest.weights_name(man)}"
            if DELTA in man["files"] and self.fs.exists(weights):
                self.fs.rm_file(weights)
        for v in versions[:-keep_optimizer]:
            ds = f"{self.base}/{vname(v)}/{DS_DIR}"
            if self.fs.exists(ds):
                self.fs.rm(ds, recursive=True)

    def pull(self, version: int, local: CheckpointStore) -> Path:
        """``version`` into the local store, verified, with its optimizer state (a trainer's
        resume on a fresh disk). The parent chain is rebuilt as serving's fetch does."""
        from flywheel.checkpoints.fetch import fetch_version

        sha = hashlib.sha256(self.manifest_bytes(version)).hexdigest()
        fetch_version(self.uri(version), version, sha, local)
        target = local.path(version) / DS_DIR
        remote_ds = f"{self.base}/{vname(version)}/{DS_DIR}"
        if not target.exists() and self.fs.exists(remote_ds):
            # into a temp dir first: a cut-short download must not look like a saved state
            tmp = local.root / f".tmp-ds-{uuid.uuid4().hex[:8]}"
            try:
                for path in self.fs.find(remote_ds):
                    rel = path[len(remote_ds):].lstrip("/")
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(path, str(tmp / rel))
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("pulled version %d from %s", version, self.url)
        return local.path(version)
