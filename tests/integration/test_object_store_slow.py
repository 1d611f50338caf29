"""The trainer, the release controller and serving's fetch on an ``s3://`` checkpoint store (moto's
S3 server on loopback), with no directory shared between them.

A trainer (real DeepSpeed steps on the CPU, its announcements on the session's broker) publishes
versions to the object store; its disk is then deleted, as a replaced pod's emptyDir is, and a new
trainer on a fresh disk resumes from the object store: the same version, step and weights, and
the same Adam moments (its optimizer state came back too). It publishes on from there. A release
controller with a data directory of its own takes the announcement from the topic and gates the
new version against version 0, fetching it from the announced URL. Slow: two DeepSpeed engines and
a gate on two cores.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import make_trainer, reward_event

from flywheel.checkpoints import ObjectStore, open_store
from flywheel.kafka.clients import make_producer
from flywheel.kafka.producers import KafkaSink
from flywheel.metrics import new_registry
from flywheel.settings import ReleaseSettings, Settings, TrainerSettings
from release.controller import Controller
from release.gate import DEFAULT_PROMPTS
from release.states import State
from release.store import ReleaseStore
from release.streams import Streams

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CFG = {"loss": "reinforce", "lr": 1e-3, "full_every": 3, "keep_full": 1, "keep_optimizer": 1}


def _trainer(model_dir: Path, data: Path, kafka_settings, topics, store: str):
    sink = KafkaSink(lambda: make_producer(kafka_settings, "trainer"))
    return make_trainer(model_dir, data, trainer_kw={"sink": sink}, topic_prefix=topics.prefix, store=store, **CFG)


def _train_and_publish(tr, start: int, rounds: int) -> None:
    for n in range(rounds):
        ids = range(start + 4 * n, start + 4 * n + 4)
        tr._train([reward_event(i) for i in ids], [("t", 0, i) for i in ids])
        tr.publish()
        assert tr._settle_outputs(10.0)  # uploaded, announced and acked


def _moments(tr) -> list[torch.Tensor]:
    opt = tr.policy.engine.optimizer
    opt = getattr(opt, "optimizer", opt)
    return [opt.state[p]["exp_avg"].detach().clone() for g in opt.param_groups for p in g["params"]
            if "exp_avg" in opt.state[p]]


def test_a_trainer_on_s3_resumes_on_a_fresh_disk_and_the_controller_gates_from_s3(
        kafka_settings, topics, tiny_model_dir, s3_url, tmp_path):
    first = _trainer(tiny_model_dir, tmp_path / "trainer-a", kafka_settings, topics, s3_url)
    first.start()  # version 0
    _train_and_publish(first, 0, 2)
    remote = ObjectStore(s3_url)
    assert remote.versions() == [0, 1, 2] and remote.announced() == 2
    step, moments = first.step, _moments(first)
    weights = {k: v.detach().clone() for k, v in first.policy.module.state_dict().items()}
    assert moments and any(m.abs().sum() > 0 for m in moments)
    shutil.rmtree(tmp_path / "trainer-a")  # the pod is replaced: nothing of its disk is left

    second = _trainer(tiny_model_dir, tmp_path / "trainer-b", kafka_settings, topics, s3_url)
    second.start()
    assert (second.version, second.step) == (2, step)
    assert all(torch.equal(a, b) for a, b in zip(moments, _moments(second), strict=True))
    assert all(torch.equal(weights[k], v) for k, v in second.policy.module.state_dict().items())
    assert {"gen-0", "gen-7"} <= second.seen_ids  # the ledgers of versions it did not pull
    _train_and_publish(second, 8, 1)
    assert remote.versions() == [0, 1, 2, 3] and remote.manifest(3)["parent"] == 2
    assert not remote.fs.exists(f"{remote.base}/v00000001/ds")  # pruned there as on disk
    shutil.rmtree(tmp_path / "trainer-b")

    data = tmp_path / "controller"
    data.mkdir()
    prompts = data / "prompts.jsonl"
    prompts.write_text("".join(DEFAULT_PROMPTS.read_text().splitlines(keepends=True)[:8]))
    settings = Settings(model_dir=tiny_model_dir, data_dir=data, topic_prefix=topics.prefix, kafka=kafka_settings,
                        trainer=TrainerSettings(store=s3_url),
                        release=ReleaseSettings(database_url=f"sqlite:///{data / 'release.sqlite3'}",
                                                gate_max_new_tokens=12, prompts_file=prompts,
                                                group_id=f"release-{topics.prefix}", tick_s=0.1))
    rs, streams = ReleaseStore(settings.release.database_url), Streams(settings, new_registry())
    try:
        ctl = Controller(settings, rs, streams, open_store(settings), new_registry())
        deadline = time.monotonic() + 300
        while (c := rs.get(3)) is None or c.state in (State.CANDIDATE, State.GATING):
            assert time.monotonic() < deadline, f"v3 still {c.state if c else 'unknown'}"
            ctl.tick()
            time.sleep(0.05)
        assert c.uri == remote.uri(3)
        assert c.gate is not None and c.gate["outcome"] in ("pass", "fail")  # gated, not a gate error
        assert not [e for e in rs.audit(3) if e.reason.startswith("gate error")]
        assert (data / "checkpoints" / "fetched" / "v00000003" / "model.safetensors").is_file()
    finally:
        streams.close()
        rs.close()
