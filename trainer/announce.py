"""Announcing published versions on the checkpoints topic, whatever the broker does meanwhile.

A version becomes durable when its directory is renamed into the store
(flywheel/checkpoints/store.py); its announcement is a second step, which a broker that does not
answer holds up and a crash or a stop can cut short. So the announcement is built from the store
alone (:func:`checkpoint_event`), and the store's ``announced`` file records the highest version
through which every announcement was acked. The trainer moves it only once its producer owes Kafka
nothing, and a start announces the versions above it before anything new. Readers therefore see
every version at least once, in order but for a send the producer had to retry; a crash between an
ack and the file's update repeats an announcement, so readers key on ``version``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from flywheel.checkpoints import CheckpointStore, adapter_of, manifest
from flywheel.contracts import BaseModelRef, CheckpointEvent, now

log = logging.getLogger(__name__)

MARK = "announced"


def announced(store: CheckpointStore) -> int:
    """The highest version through which every announcement was acked (-1: none yet).

    Call it at start, before publishing: a store without the mark gets one then. A fresh store
    starts at -1; one written before the mark existed counts as announced through its latest
    version, as its trainer announced each version before it went on. With an object store
    (``store.remote``) a local store without the mark (a fresh disk) takes the object store's.
    """
    path = store.root / MARK
    try:
        return int(path.read_text())
    except FileNotFoundError:
        theirs = store.remote.announced() if store.remote is not None else None
        if theirs is not None:
            _write_mark(store, theirs)
            return theirs
        latest = store.latest()
        mark_announced(store, -1 if latest is None else latest)
        return -1 if latest is None else latest
    except ValueError:  # it is replaced atomically, so only a hand edit leaves it unreadable
        log.warning("%s is not a version number; announcing every version again", path)
        return -1


def mark_announced(store: CheckpointStore, version: int) -> None:
    _write_mark(store, version)
    if store.remote is not None:  # a trainer restarted on a fresh disk reads it there
        store.remote.mark_announced(version)


def _write_mark(store: CheckpointStore, version: int) -> None:
    path = store.root / MARK
    tmp = path.with_name(f".{MARK}.tmp")
    tmp.write_text(str(version))
    os.replace(tmp, path)


def checkpoint_event(store: CheckpointStore, version: int) -> CheckpointEvent:
    """The announcement of a committed ``version``, from what the store holds.

    With an object store (``store.remote``, the trainer's ``store`` setting a URL) the version is
    published there first (again, after a crash: it uploads nothing when the same manifest is
    there, flywheel/checkpoints/remote.py) and announced with its URL.
    """
    path = store.path(version)
    man = store.manifest(version)
    uri = store.remote.publish(path) if store.remote is not None else str(path.resolve())
    if store.remote is not None:
        store.remote.prune(store.keep_full, store.keep_optimizer)
    return CheckpointEvent(
        version=version, parent=man.get("parent"), step=man.get("step", 0), uri=uri,
        manifest_sha256=manifest.sha256_file(path / manifest.MANIFEST_NAME), dtype=_dtype(man, path),
        full_snapshot=man["full_snapshot"], samples=man.get("samples", 0), metrics=man.get("metrics", {}),
        created_at=now(), base=_base(man),
    )


def _base(man: dict) -> BaseModelRef | None:
    """The base an adapter version needs, as readers of the announcement check it."""
    adapter = adapter_of(man)
    if adapter is None:
        return None
    return BaseModelRef(name=adapter.base_name, manifest_sha256=adapter.base_manifest_sha256)


#: safetensors dtype names (what the manifest records of the weights) as torch names them
_TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def _dtype(man: dict, path: Path) -> str:
    """The served dtype as torch names it: the weights' own (all of one dtype), else config.json's."""
    if man.get("dtype") in _TORCH_NAMES:
        return _TORCH_NAMES[man["dtype"]]
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
