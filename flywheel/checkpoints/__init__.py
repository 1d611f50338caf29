"""The checkpoint store's format, shared by its writer (the trainer) and its readers (serving, the
``flywheel checkpoint`` commands, a release controller, tools).

A published version is a Hugging Face model directory under the store root plus a manifest of
per-file and per-tensor sha256 hashes; old versions keep only a lossless delta from their parent.
In LoRA mode a version is a PEFT adapter directory instead, on a base model its manifest names by
hash (``adapter_of(manifest)``, ``verify_base(base_dir, adapter)``).

    store = open_store(settings)          # or CheckpointStore(root) for a directory at hand
    store.versions(), store.latest()      # published versions, oldest first
    store.manifest(v), store.ledger(v)    # what a version holds and what it was trained on
    store.materialize_bytes(v)            # verify: rebuild v's weights from its chain, every hash checked
    store.export(v, out)                  # reconstruct: a verified, loadable model directory in ``out``
    verify_dir(model_dir)                 # check any model directory against its manifest

Modules: :mod:`.store` (layout, atomic publish, pruning, reconstruction), :mod:`.remote` (the
store on S3 or any fsspec URL: publish, pull, the publish rule), :mod:`.manifest` (manifests and
hashes), :mod:`.delta` (the delta codec), :mod:`.cli` (``flywheel checkpoint verify|reconstruct``). Nothing here imports torch or a stage package.
"""

from flywheel.checkpoints.delta import DeltaError
from flywheel.checkpoints.manifest import (
    ADAPTER_CONFIG,
    MANIFEST_NAME,
    Adapter,
    ManifestError,
    adapter_of,
    verify_base,
    verify_dir,
)
from flywheel.checkpoints.remote import ObjectStore
from flywheel.checkpoints.store import (
    ADAPTER_WEIGHTS,
    DELTA,
    LEDGER,
    WEIGHTS,
    CheckpointStore,
    open_store,
    store_root,
    verify_tensors,
    vname,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DELTA",
    "LEDGER",
    "MANIFEST_NAME",
    "WEIGHTS",
    "Adapter",
    "CheckpointStore",
    "DeltaError",
    "ManifestError",
    "ObjectStore",
    "adapter_of",
    "open_store",
    "store_root",
    "verify_base",
    "verify_dir",
    "verify_tensors",
    "vname",
]
