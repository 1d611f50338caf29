"""Checkpoints on an object store: publish and fetch against the local filesystem, and a delta's
fetch against the full version's.

    .venv/bin/python bench/object_store.py [--model-dir DIR] [--repeat 5] [--json out.json]

The object store is moto's S3 server on loopback (the tests' local S3 API), reached through the
standard ``AWS_ENDPOINT_URL`` as MinIO or S3 would be, through the store's own code
(flywheel/checkpoints/remote.py, fetch.py). Loopback HTTP has no network between the two, so
these figures are what the S3 protocol and its client cost here, a lower bound on a real store.

The model is the built one (``flywheel model init``'s), or ``--model-dir`` (an imported SmolLM2,
say), its weights published in bfloat16 as the trainer serves them. Version 1 is version 0 after
a small relative move of every weight (most bf16 values stay, as after an RL step), so its delta
is small. Rows, medians of ``--repeat`` alternated runs:

- publish: :meth:`ObjectStore.publish` of a committed version, against copying the same
  directory into another directory of the same disk, fsynced (what a local store's publish
  writes);
- fetch: :func:`fetch_version` from the ``s3://`` URL into an empty cache, against the same
  function from the local directory (both copy, then check every file and tensor);
- delta: a reader that holds version 0 fetches version 1 stored as its delta only (fetch, apply,
  verify), against version 1 fetched whole from the object store. The owner's call (issue 44): a
  delta is meant to pay where fetching is expensive, so it is judged against the full fetch from
  the object store, not against a local disk read. Goal: not slower (ratio <= 1.0).

Prints the rows; ``--json`` writes them for ``flywheel bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the delta row's goal: fetching and applying a delta is no slower than fetching the version whole
DELTA_GOAL = "<= 1.0"


def start_s3() -> object:
    """moto's S3 server on a free loopback port, and the AWS variables pointing clients at it."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    return server


def versions(model_dir: Path, root: Path):
    """A local store with version 0 (the model in bf16) and version 1 (a small move, a delta)."""
    import torch
    from safetensors.torch import load_file, save_file

    from flywheel.checkpoints import CheckpointStore

    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()})
    gen = torch.Generator().manual_seed(0)
    moved = {k: (v.float() * (1 + 2e-3 * torch.randn(v.shape, generator=gen))).to(torch.bfloat16)
             for k, v in weights.items()}
    store = CheckpointStore(root, full_every=100, keep_full=100)
    for version, w in ((0, weights), (1, moved)):
        tmp = store.staging_dir(version)
        save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        store.commit(tmp, version=version, parent=version - 1 if version else None, source_dir=model_dir,
                     extra={}, ledger={"trained": [], "dropped": {}})
    return store


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(model_dir: Path, repeat: int, work: Path) -> dict:
    import fsspec

    from flywheel.checkpoints import CheckpointStore, ObjectStore, manifest
    from flywheel.checkpoints.fetch import fetch_version
    from flywheel.durable import fsync_tree

    local = versions(model_dir, work / "trainer")
    sha = {v: manifest.sha256_file(local.path(v) / manifest.MANIFEST_NAME) for v in (0, 1)}
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3").mkdir(bucket)
    whole, deltas = ObjectStore(f"s3://{bucket}/whole"), ObjectStore(f"s3://{bucket}/delta")
    for v in (0, 1):
        whole.publish(local.path(v))
        deltas.publish(local.path(v))
    deltas.fs.rm_file(f"{deltas.base}/v00000001/model.safetensors")  # pruned to its delta, as the store prunes
    t: dict[str, list[float]] = {k: [] for k in ("publish_s3", "publish_local", "fetch_s3", "fetch_local",
                                                 "delta_s3", "full_s3")}
    for i in range(repeat):
        target = ObjectStore(f"s3://{bucket}/publish-{i}")
        copy = work / f"copy-{i}" / "v00000000"

        def copy_local(copy: Path = copy) -> None:
            shutil.copytree(local.path(0), copy)
            fsync_tree(copy)

        a, b = CheckpointStore(work / f"a-{i}"), CheckpointStore(work / f"b-{i}")
        t["publish_s3"].append(timed(lambda target=target: target.publish(local.path(0))))
        t["publish_local"].append(timed(copy_local))
        t["fetch_s3"].append(timed(lambda a=a: fetch_version(whole.uri(0), 0, sha[0], a)))
        t["fetch_local"].append(timed(lambda b=b: fetch_version(str(local.path(0)), 0, sha[0], b)))
        for key, store in (("delta_s3", deltas), ("full_s3", whole)):
            cache = CheckpointStore(work / f"{key}-{i}")
            fetch_version(store.uri(0), 0, sha[0], cache)  # the reader holds version 0 already
            t[key].append(timed(lambda store=store, cache=cache: fetch_version(store.uri(1), 1, sha[1], cache)))
        for p in work.glob(f"*-{i}"):
            shutil.rmtree(p)
    med = {k: statistics.median(v) for k, v in t.items()}
    man = local.manifest(1)
    mib = man["weight_bytes"] / (1 << 20)
    what = f"{model_dir.name}, {mib:.1f} MiB bf16 weights, moto S3 on loopback, median of {repeat}"
    return {"rows": [
        {"name": "checkpoint publish: S3 vs local filesystem", "value": med["publish_s3"],
         "baseline": med["publish_local"], "unit": "s", "goal": None, "note": what},
        {"name": "checkpoint fetch + verify: S3 vs local filesystem", "value": med["fetch_s3"],
         "baseline": med["fetch_local"], "unit": "s", "goal": None, "note": what},
        {"name": "delta fetch + apply vs full fetch from S3", "value": med["delta_s3"], "baseline": med["full_s3"],
         "unit": "s", "goal": DELTA_GOAL,
         "note": f"{what}; delta {man['delta_bytes'] / (1 << 20):.2f} MiB ({man['delta_ratio']:.1f}x smaller)"},
    ], "seconds": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="a Hugging Face model directory (default: the built model)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    server = start_s3()
    try:
        with tempfile.TemporaryDirectory(prefix="flywheel-bench-s3-") as tmp:
            work = Path(tmp)
            model_dir = args.model_dir
            if model_dir is None:
                from flywheel.modelinit import ModelSpec, init_model

                model_dir = init_model(work / "built-model", ModelSpec())
            out = measure(model_dir, args.repeat, work)
    finally:
        server.stop()
    for r in out["rows"]:
        print(f"{r['name']:<52} {r['value']:8.3f} s  vs {r['baseline']:8.3f} s  ({r['value'] / r['baseline']:.2f}x)  {r['note']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
