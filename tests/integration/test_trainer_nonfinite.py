"""Records that once turned every weight NaN, for good: real DeepSpeed steps on the CPU.

Each of these passed the trainer's edge and made the loss or its gradient non-finite: a behaviour
logprob of -100 (ratio overflow), a temperature that is 0 in float32. The edge now refuses what it
can (tests/unit/test_trainer_batching.py), the ratio is clamped (tests/unit/test_trainer_losses.py),
and a batch whose loss is still not finite is dead-lettered with no step taken.
"""

from __future__ import annotations

import base64
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import ListSink, make_trainer, reward_event

from flywheel.contracts import DeadLetterEvent, RewardEvent, SamplingParams, decode, encode
from flywheel.metrics import new_registry
from flywheel.stream.deadletters import DeadLetters
from trainer.batching import DEADLETTER_REASONS

pytestmark = pytest.mark.integration


def weights(tr) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.policy.module.state_dict().items()}


def all_finite(ws: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in ws.values())


@pytest.fixture
def trainer(tiny_model_dir, tmp_path):
    sink = ListSink()
    dead = DeadLetters(sink, "t.deadletter", "trainer", new_registry(), DEADLETTER_REASONS)
    tr = make_trainer(tiny_model_dir, tmp_path, {"deadletters": dead}, loss="grpo", lr=1e-3)
    tr.start()
    return tr, sink


def batch(start: int, **kw) -> tuple[list[RewardEvent], list[tuple[str, int, int]]]:
    events = [reward_event(start + k, group="g", reward=float(k % 2), **kw) for k in range(4)]
    return events, [("t.rewards", 0, start + k) for k in range(4)]


def test_a_batch_with_a_non_finite_loss_is_dead_lettered_and_takes_no_step(trainer):
    tr, sink = trainer
    before, step = weights(tr), tr.step
    events, pos = batch(0)
    events[1] = events[1].model_copy(update={"reward": float("nan")})  # past the edge: only the loss can tell
    tr.seen_ids.update(e.generation_id for e in events)  # as their intake did
    tr._train(events, pos)
    assert tr.step == step and all(torch.equal(before[k], w) for k, w in weights(tr).items())
    letters = [decode(DeadLetterEvent, v) for _, _, v in sink.records]
    assert [(d.reason, d.source_offset) for d in letters] == [("nonfinite_loss", k) for k in range(4)]
    assert decode(RewardEvent, base64.b64decode(letters[0].value_b64)) == events[0]  # replayable
    assert all(tr.book.is_settled(*p) for p in pos)
    assert tr.m.dropped.labels("nonfinite_loss")._value.get() == 4
    assert tr.ledger.trained == []
    # replayed, once the cause is fixed: taken in again, not dropped as a duplicate
    fixed = events[1].model_copy(update={"reward": 1.0})
    tr._intake(SimpleNamespace(topic="t.rewards", partition=0, offset=100, key=fixed.generation_id.encode(),
                               value=encode(fixed), headers=[]))
    assert tr.m.dropped.labels("duplicate")._value.get() == 0 and fixed.generation_id in tr.seen_ids

    events, pos = batch(10)  # the next batch trains as usual
    tr._train(events, pos)
    after = weights(tr)
    assert tr.step == step + 1 and all_finite(after) and any(not torch.equal(before[k], after[k]) for k in after)


@pytest.mark.parametrize("kw", [
    {"logprobs": (-100.0, -5.0, -5.0, -5.0, -5.0, -5.0)},  # exp(trainer - behaviour) overflows float32
    {"temperature": 1e-300},  # 0 in float32: logits / 0
])
def test_records_that_made_every_weight_nan_now_train_finitely(trainer, kw):
    tr, sink = trainer
    temperature = kw.pop("temperature", None)
    events, pos = batch(0, **kw)
    if temperature is not None:
        greedy = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=16)
        events = [e.model_copy(update={"sampling": greedy}) for e in events]
    before = weights(tr)
    for i in range(3):
        tr._train(events, [(t, p, o + 10 * i) for t, p, o in pos])
    after = weights(tr)
    assert all_finite(after) and any(not torch.equal(before[k], after[k]) for k in after)
    assert not sink.records
    assert all(math.isfinite(v) for v in tr.last_stats.values())  # nothing NaN for a checkpoint's metrics
