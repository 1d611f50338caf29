"""``flywheel checkpoint verify [VERSION]``, ``reconstruct VERSION OUT`` and ``merge VERSION OUT``.

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

from flywheel.checkpoints.manifest import ManifestError, adapter_of
from flywheel.checkpoints.store import open_store
from flywheel.progress import for_terminal, is_terminal, quiet_library_bars
from flywheel.settings import Settings


def run(settings: Settings, args: argparse.Namespace) -> int:
    store = open_store(settings)
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
