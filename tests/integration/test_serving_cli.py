"""``flywheel serve`` as a process: verified start on the released versions, real requests, clean
SIGTERM with a flushed publisher.

Slow (the process starts its own two vLLM engines, about 50 s), so it runs with ``make test-slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from flywheel.contracts import (
    FeedbackEvent,
    GenerationEvent,
    ReleaseEvent,
    VersionRef,
    decode,
    encode,
)
from local.broker import free_port
from tests.conftest import read_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _store_with_versions(model_dir, root, n: int):
    """Versions 1..n after the model directory's, each its parent plus a little noise."""
    import torch
    from safetensors.torch import load_file, save_file

    from flywheel.checkpoints import CheckpointStore

    store = CheckpointStore(root, full_every=100, keep_full=1)
    weights = load_file(str(model_dir / "model.safetensors"))
    for v in range(n + 1):
        tmp = store.staging_dir(v)
        weights = {k: t + 1e-2 * torch.randn_like(t) for k, t in weights.items()} if v else weights
        save_file(weights, str(tmp / "model.safetensors"))
        store.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=model_dir, extra={}, ledger={})
    return store


def _ref(store, v: int) -> VersionRef:
    import hashlib

    sha = hashlib.sha256((store.path(v) / "flywheel-manifest.json").read_bytes()).hexdigest()
    return VersionRef(version=v, uri=str(store.path(v)), manifest_sha256=sha)


def test_serve_process_starts_on_the_released_versions_and_flushes_on_sigterm(broker, topics, tiny_model_dir, tmp_path):
    from kafka import KafkaProducer

    store = _store_with_versions(tiny_model_dir, tmp_path / "checkpoints", 2)
    release = ReleaseEvent(revision=4, stable_version=1, canary_version=2, canary_share=0.5, stable_ref=_ref(store, 1),
                           canary_ref=_ref(store, 2), updated_at=time.time())
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    producer.send(topics.releases, key=b"flywheel", value=encode(release)).get(timeout=10)
    producer.close()
    port = free_port()
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(tiny_model_dir), "FLYWHEEL_DATA_DIR": str(tmp_path),
           "FLYWHEEL_API_KEYS": "sk-cli", "FLYWHEEL_SERVE_USER_ID_SALT": "test-salt-of-sixteen-characters",
           "FLYWHEEL_ROUTING_SECRET": "test-routing-secret-of-sixteen", "FLYWHEEL_SERVE_VERSION_VISIBLE_KEYS": "sk-cli",
           "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap,
           "FLYWHEEL_TOPIC_PREFIX": topics.prefix, "FLYWHEEL_SERVE_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-cli"}
    try:
        deadline = time.monotonic() + 420  # two engines start, then warm up, on a shared 2-core machine
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not become ready"
            time.sleep(0.5)
        assert httpx.get(url + "/livez", timeout=5).json() == {"ok": True}
        # the first answer is already on the released versions: nothing was served from the
        # model directory before the release was applied
        health = httpx.get(url + "/health", headers=auth, timeout=5).json()
        assert health["versions"] == {"stable": 1, "canary": 2} and health["releases"]["revision"] == 4
        gen = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                         json={"model": "flywheel", "prompt": "hello", "max_tokens": 4}).json()
        assert gen["model"] in ("flywheel@v1", "flywheel@v2")
        fb = httpx.post(url + "/v1/feedback", headers=auth, timeout=60,
                        json={"feedback_id": "cli-1", "generation_id": gen["id"], "signal": "accept"})
        assert fb.status_code == 202
        # SIGTERM with a stream in flight: it runs to its last token (serve.drain_s), then the
        # process exits cleanly
        body = {"model": "flywheel", "prompt": "a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", headers=auth, json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gens = [decode(GenerationEvent, r.value) for r in read_all(broker.bootstrap, topics.generations, expect=2)]
    fbs = [decode(FeedbackEvent, r.value) for r in read_all(broker.bootstrap, topics.feedback, expect=1)]
    assert sorted(g.generation_id for g in gens) == sorted([gen["id"], chunks[0]["id"]])
    assert [f.feedback_id for f in fbs] == ["cli-1"]


def test_serve_process_refuses_unverified_weights(tiny_model_dir, tmp_path):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "flywheel-manifest.json").unlink()
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(bad), "FLYWHEEL_API_KEYS": "k",
           "FLYWHEEL_SERVE_USER_ID_SALT": "a-salt-of-sixteen-or-more"}
    done = subprocess.run([sys.executable, "-m", "cli", "serve"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "refusing" in done.stderr
