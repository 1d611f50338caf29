"""``flywheel checkpoint list``, ``verify [VERSION]``, ``reconstruct VERSION OUT`` and ``merge VERSION OUT``.

``list [-o json]`` shows every version in the store from its manifest, reading no weights: the
JSON object is ``{"store": PATH, "versions": [...]}``, each version's ``version``, ``parent``,
``step``, ``samples``, ``created_at``, ``kind`` (``full`` or ``adapter``), ``base`` (an adapter's
base model, else null), ``snapshot`` (a full snapshot starts a chain), ``weights`` (``file``:
held whole; ``delta``: pruned to its delta, rebuilt on use) and ``manifest_sha256``.

Each rebuilds the version from its chain (nearest full weights + deltas) and checks every file and
tensor hash on the way; a corrupted or tampered file fails with the version and file named.
The store is the one the settings name (:func:`~flywheel.checkpoints.store.open_store`), so these
run wherever the store is readable, without the trainer. With ``trainer.store`` an object store's
URL, that is the object store (remote.py), not the trainer's working copy: ``list`` reads its
manifests, and the others fetch the version into a temporary cache beside the working copy,
verifying every file and tensor on the way (fetch.py), then go on as for a directory.
``verify`` and ``reconstruct`` need neither torch nor a model; ``merge`` takes a LoRA version,
checks the base model (``model_dir``) is the one its manifest names by hash, and writes the two
merged into a full-weight Hugging Face directory with a manifest (flywheel/adapters.py): what a
deployment serves without LoRA, or a new base to train on.

On a terminal each step shows a progress bar on stderr (bytes read, rebuilt, hashed, copied, of
its total: flywheel/progress.py); not on one (a pipe, a log file, a job), nothing but the result.
The result line is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError, adapter_of
from flywheel.checkpoints.store import CheckpointStore, open_store, pruned
from flywheel.output import emit, table
from flywheel.progress import for_terminal, is_terminal, quiet_library_bars
from flywheel.settings import Settings


def listing(store: CheckpointStore) -> dict[str, Any]:
    """The store's versions from their manifests (module docstring), oldest first; a version whose
    manifest cannot be read (being pruned, half-copied by a mirror) is listed with an ``error``."""
    rows: list[dict[str, Any]] = []
    remote = store.remote
    for v in store.versions() if remote is None else remote.versions():
        try:
            raw = (store.path(v) / MANIFEST_NAME).read_bytes() if remote is None else remote.manifest_bytes(v)
            man = store.manifest(v) if remote is None else remote.manifest(v)
            adapter = adapter_of(man)
            delta = pruned(store.path(v), man) if remote is None else remote.pruned(v, man)
        except (OSError, ValueError) as exc:  # ManifestError, and JSON that does not parse
            rows.append({"version": v, "error": str(exc)})
            continue
        rows.append({"version": v, "parent": man.get("parent"), "step": man.get("step"),
                     "samples": man.get("samples"), "created_at": man.get("created_at"),
                     "kind": "adapter" if adapter else "full", "base": adapter.base_name if adapter else None,
                     "snapshot": bool(man.get("full_snapshot", man.get("parent") is None)),
                     "weights": "delta" if delta else "file", "manifest_sha256": hashlib.sha256(raw).hexdigest()})
    return {"store": str(store.root) if remote is None else remote.url, "versions": rows}


@contextlib.contextmanager
def readable(store: CheckpointStore, version: int) -> Iterator[CheckpointStore]:
    """Where ``version`` is read from: ``store`` itself, or, when the settings name an object
    store, a temporary cache beside its working copy that ``version`` is fetched into and verified
    against the store's manifest on the way (fetch.py; its chain too). A version the store refuses
    raises :class:`~flywheel.checkpoints.manifest.ManifestError`, as a broken local one does."""
    if store.remote is None:
        yield store
        return
    from flywheel.checkpoints.fetch import VersionRefused, fetch_version

    remote = store.remote
    with tempfile.TemporaryDirectory(prefix=".checkpoint-cli-", dir=store.root) as tmp:
        cache = CheckpointStore(tmp)
        try:
            fetch_version(remote.uri(version), version, hashlib.sha256(remote.manifest_bytes(version)).hexdigest(),
                          cache)
        except (VersionRefused, FileNotFoundError) as exc:
            raise ManifestError(f"{remote.uri(version)}: {exc}") from None
        yield cache


def render(body: dict[str, Any]) -> str:
    if not body["versions"]:
        return f"no versions in {body['store']}"
    rows = [(r["version"], r.get("parent"), r.get("step"), r.get("samples"), r.get("kind", "?"),
             r.get("weights", r.get("error")), _utc(r.get("created_at"))) for r in body["versions"]]
    return table(("VERSION", "PARENT", "STEP", "SAMPLES", "KIND", "WEIGHTS", "CREATED"), rows)


def _utc(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def run(settings: Settings, args: argparse.Namespace) -> int:
    store = open_store(settings)
    if args.action == "list":
        emit(args, listing(store), render)
        return 0
    source = store.root if store.remote is None else store.remote.url
    if args.version is not None:
        version = args.version
    else:
        version = store.latest() if store.remote is None else store.remote.latest()
    if version is None:
        print(f"no versions in {source}", file=sys.stderr)
        return 1
    progress = for_terminal()
    try:
        with readable(store, version) as local:
            _act(local, version, settings, args, progress)
    except ManifestError as exc:
        print(f"version {version}: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def _act(store: CheckpointStore, version: int, settings: Settings, args: argparse.Namespace, progress: Any) -> None:
    """``verify``, ``merge`` or ``reconstruct`` of ``version``, read from ``store``."""
    if args.action == "verify":
        data = store.materialize_bytes(version, progress)
        kind = f"adapter on base {a.base_name!r}, " if (a := adapter_of(store.manifest(version))) else ""
        print(f"version {version}: OK ({kind}{len(data)} weight bytes verified)")
    elif args.action == "merge":
        from flywheel.adapters import merge_version

        if not is_terminal():
            quiet_library_bars()  # transformers draws its loading bars on any stderr
        # DeepSpeed, imported on the way by PEFT, logs its accelerator warning to stdout: the
        # one line a script reads there is the result below
        with contextlib.redirect_stdout(sys.stderr):
            merge_version(store.materialize(version, progress), settings.model_dir, args.out, progress)
        print(f"version {version} merged into its base {settings.model_dir}: full weights in {args.out}")
    else:
        out = store.export(version, args.out, progress)
        print(f"version {version} written to {out}")
