"""``flywheel serve`` as a process: verified start, real requests, clean SIGTERM with a flushed publisher.

Slow (the process starts its own vLLM engine, about 25 s), so it runs with ``make test-slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from flywheel.contracts import FeedbackEvent, GenerationEvent, decode
from local.broker import free_port
from tests.conftest import read_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_process_answers_and_flushes_on_sigterm(broker, topics, tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(tiny_model_dir), "FLYWHEEL_DATA_DIR": str(tmp_path),
           "FLYWHEEL_API_KEYS": "sk-cli", "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap,
           "FLYWHEEL_TOPIC_PREFIX": topics.prefix, "FLYWHEEL_SERVE_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-cli"}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not become healthy"
            time.sleep(0.5)
        gen = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                         json={"model": "flywheel", "prompt": "hello", "max_tokens": 4}).json()
        fb = httpx.post(url + "/v1/feedback", headers=auth, timeout=60,
                        json={"feedback_id": "cli-1", "generation_id": gen["id"], "signal": "accept"})
        assert fb.status_code == 202
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gens = [decode(GenerationEvent, r.value) for r in read_all(broker.bootstrap, topics.generations, expect=1)]
    fbs = [decode(FeedbackEvent, r.value) for r in read_all(broker.bootstrap, topics.feedback, expect=1)]
    assert [g.generation_id for g in gens] == [gen["id"]]
    assert [f.feedback_id for f in fbs] == ["cli-1"]


def test_serve_process_refuses_unverified_weights(tiny_model_dir, tmp_path):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "flywheel-manifest.json").unlink()
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(bad), "FLYWHEEL_API_KEYS": "k"}
    done = subprocess.run([sys.executable, "-m", "cli", "serve"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "refusing" in done.stderr
