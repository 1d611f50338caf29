"""``flywheel checkpoint verify [VERSION]`` and ``flywheel checkpoint reconstruct VERSION OUT``.

Both rebuild the version from its chain (nearest full weights + deltas) and check every file and
tensor hash on the way; a corrupted or tampered file fails with the version and file named.
The store is the one the settings name (:func:`~flywheel.checkpoints.store.open_store`), so these
run wherever the store is readable, without the trainer or its dependencies.
"""

from __future__ import annotations

import argparse
import sys

from flywheel.checkpoints.manifest import ManifestError
from flywheel.checkpoints.store import open_store
from flywheel.settings import Settings


def run(settings: Settings, args: argparse.Namespace) -> int:
    store = open_store(settings)
    version = args.version if args.version is not None else store.latest()
    if version is None:
        print(f"no versions in {store.root}", file=sys.stderr)
        return 1
    try:
        if args.action == "verify":
            data = store.materialize_bytes(version)
            print(f"version {version}: OK ({len(data)} weight bytes verified)")
        else:
            out = store.export(version, args.out)
            print(f"version {version} written to {out}")
    except ManifestError as exc:
        print(f"version {version}: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0
