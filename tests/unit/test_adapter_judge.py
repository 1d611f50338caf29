"""What the adapter engine (and full-weight engines) may load: serving/adapters.py's pure judge,
one row per rule, and the setting that turns the adapter engine on."""

from __future__ import annotations

import pytest

from flywheel.checkpoints.manifest import Adapter
from flywheel.settings import ServeSettings, Settings, TrainerSettings
from serving.adapters import LORA_REFUSALS, judge_version, lora_on

BASE = "a" * 64
OTHER = "b" * 64


def _adapter(sha: str = BASE, rank: int = 8) -> Adapter:
    return Adapter("tiny", sha, rank, 16.0, ("all-linear",))


@pytest.mark.parametrize(("adapter", "is_base", "lora_engine", "want"), [
    (None, True, True, None),                               # the base itself, on the adapter engine
    (None, False, True, "needs_full_engines"),              # another full-weight version cannot share it
    (None, False, False, None),                             # full weights on full-weight engines
    (_adapter(), False, False, "needs_lora_engine"),         # an adapter needs the adapter engine
    (_adapter(), False, True, None),                        # an adapter on this very base
    (_adapter(OTHER), False, True, "wrong_base"),           # ... on another base
    (_adapter(rank=32), False, True, "lora_rank_too_high"),  # ... above serve.max_lora_rank
    (_adapter(rank=16), False, True, None),                 # ... at it
])
def test_judge_version(adapter, is_base, lora_engine, want):
    got = judge_version(7, adapter, is_base=is_base, lora_engine=lora_engine, base_sha256=BASE, max_rank=16)
    assert (got.reason if got else None) == want
    if got is not None:
        assert got.reason in LORA_REFUSALS and "version 7" in got.detail


@pytest.mark.parametrize(("mode", "rank", "want"), [
    ("auto", 0, False), ("auto", 8, True), ("on", 0, True), ("off", 8, False),
])
def test_the_adapter_engine_follows_the_trainer_unless_told(mode, rank, want):
    assert lora_on(Settings(serve=ServeSettings(lora=mode), trainer=TrainerSettings(lora_rank=rank))) is want


def test_max_lora_rank_takes_only_the_ranks_vllm_takes():
    with pytest.raises(ValueError):
        ServeSettings(max_lora_rank=12)
