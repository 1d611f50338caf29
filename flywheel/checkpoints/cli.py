"""``flywheel checkpoint list``, ``verify [VERSION]``, ``reconstruct VERSION OUT`` and ``merge VERSION OUT``.

``list [-o json]`` shows every version in the store from its manifest, reading no weights: the
JSON object is ``{"store": PATH, "versions": [...]}``, each version's ``version``, ``parent``,
``step``, ``samples``, ``created_at``, ``kind`` (``full`` or ``adapter``), ``base`` (an adapter's
base model, else null), ``snapshot`` (a full snapshot starts a chain), ``weights`` (``file``:
held whole; ``delta``: pruned to its delta, rebuilt on use) and ``manifest_sha256``.

Each rebuilds the version from its chain (nearest full weights + deltas) and checks every file and
tensor hash on the way; a corrupted or tampered file fails with the version and file named.
The store is the one the settings name (:func:`~flywheel.checkpoints.store.open_store`), so these
run wherever the store is readable, without the trainer. ``verify`` and ``reconstruct`` need
neither torch nor a model; ``merge`` takes a LoRA version, checks the base model (``model_dir``)
is the one its manifest names by hash, and writes the two merged into a full-weight Hugging Face
directory with a manifest (flywheel/adapters.py): what a deployment serves without LoRA, or a new
base to train on.

On a terminal each step shows a progress bar on stderr (bytes read, rebuilt, hashed, copied, of
its total: flywheel/progress.py); not on one (a pipe, a log file, a job), nothing but the result.
The result line is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from flywheel.checkpoints.manifest import MANIFEST_NAME, ManifestError, adapter_of, sha256_file
from flywheel.checkpoints.store import CheckpointStore, open_store, pruned
from flywheel.output import emit, table
from flywheel.progress import for_terminal, is_terminal, quiet_library_bars
from flywheel.settings import Settings


def listing(store: CheckpointStore) -> dict[str, Any]:
    """The store's versions from their manifests (module docstring), oldest first; a version whose
    manifest cannot be read (being pruned, half-copied by a mirror) is listed with an ``error``."""
    rows: list[dict[str, Any]] = []
    for v in store.versions():
        try:
            man = store.manifest(v)
            adapter = adapter_of(man)
        except (OSError, ManifestError) as exc:
            rows.append({"version": v, "error": str(exc)})
            continue
        rows.append({"version": v, "parent": man.get("parent"), "step": man.get("step"),
                     "samples": man.get("samples"), "created_at": man.get("created_at"),
                     "kind": "adapter" if adapter else "full", "base": adapter.base_name if adapter else None,
                     "snapshot": bool(man.get("full_snapshot", man.get("parent") is None)),
                     "weights": "delta" if pruned(store.path(v), man) else "file",
                     "manifest_sha256": sha256_file(store.path(v) / MANIFEST_NAME)})
    return {"store": str(store.root), "versions": rows}


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
    version = args.version if args.version is not None else store.latest()
    if version is None:
        print(f"no versions in {store.root}", file=sys.stderr)
        return 1
    progress = for_terminal()
    try:
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
    except ManifestError as exc:
        print(f"version {version}: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0
