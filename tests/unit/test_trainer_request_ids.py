"""The trainer's request ids of samples taken in (trainer/loop.py): each leaves with its sample,
trained or dropped, so the map holds only what waits in the batcher."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from trainer_helpers import reward_event

from flywheel.checkpoints import CheckpointStore
from flywheel.contracts import encode
from flywheel.metrics import new_registry
from flywheel.settings import Settings, TrainerSettings
from flywheel.telemetry import REQUEST_ID_HEADER
from trainer.loop import Trainer
from trainer.metrics import TrainerMetrics


def record(i: int, version: int, group: str) -> SimpleNamespace:
    return SimpleNamespace(topic="rewards", partition=0, offset=i, value=encode(reward_event(i, version=version, group=group)),
                           headers=[(REQUEST_ID_HEADER, f"req-{i}".encode())])


def test_samples_evicted_as_stale_take_their_request_ids_with_them(tmp_path):
    settings = Settings(trainer=TrainerSettings(batch_size=64, group_size=4, max_staleness=1))
    policy = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(vocab_size=512)),
                             save=lambda path, client_state: None)
    trainer = Trainer(settings, policy, CheckpointStore(tmp_path), TrainerMetrics(new_registry()))
    trainer._commit = lambda tmp, version: True  # the weights' files are not this test's business
    trainer.version = 0
    for i in range(6):  # two groups of 4 never completed: they wait in the batcher
        trainer._intake(record(i, version=0, group=f"grp-{i % 2}"))
    assert set(trainer.request_ids) == {f"gen-{i}" for i in range(6)}
    assert trainer.publish() and trainer.publish()  # version 2: every waiting sample is past max_staleness
    assert trainer.request_ids == {}
    assert sorted(trainer.ledger.dropped["stale"]) == [f"gen-{i}" for i in range(6)]
