"""The archives' fast readers of topic bytes (ingest/archive.py, reward/report.py) parse records
without the contract's validation, for speed: here each is fed records built and encoded through
flywheel/contracts.py, and every column it keeps must equal the field of the decoded event, so a
field renamed in the contract fails here instead of archiving a column of nulls."""

from __future__ import annotations

import math

import pytest

from flywheel.contracts import (
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from reward.report import REWARD_SCHEMA, reward_table

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
GEN = GenerationEvent(generation_id="g1", group_id="grp", choice_index=2, model_name="m", model_version=5,
                      user_id="u", endpoint="chat", created_at=1000.25, completed_at=1001.5, latency_ms=1250.0,
                      prompt_text="p é", prompt_token_ids=(3, 4), completion_text="c", completion_token_ids=(7, 8, 9),
                      logprobs=(-0.5, -1.25, -2.0), sampling=SAMPLING, finish_reason="length",
                      api_key_id="key-0123456789ab")
EPISODE = EpisodeEvent(generation=GEN, signal="edit", edited_text="new", decision_ms=42.5, feedback_ids=("a", "b"),
                       conflicted=True, rater_id="r", resolved_at=1005.75)
REWARD = RewardEvent(generation_id="g1", group_id="grp", user_id="u", rater_id="r", model_version=5, signal="edit",
                     prompt_token_ids=(3, 4), completion_token_ids=(7, 8, 9), logprobs=(-0.5, -1.25, -2.0),
                     sampling=SAMPLING, reward=0.5, components={"signal": 0.25, "edit": 0.25}, weight=0.75,
                     flags=("long",), generated_at=1000.25, labeled_at=1006.0)


def _field(event, name: str):
    value = getattr(event, name)
    return list(value) if isinstance(value, tuple) else value


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)  # logprobs are archived as float32
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("path", ["row", "table"])
def test_every_episode_column_is_the_decoded_events_field(path):
    raw = encode(EPISODE)
    ep = decode(EpisodeEvent, raw)
    if path == "row":
        stamp, row = episode_row(raw)
    else:
        stamps, table = episode_table([raw])
        stamp, row = stamps[0], table.to_pylist()[0]
    assert stamp == ep.resolved_at
    for name in EPISODE_SCHEMA.names:
        want = _field(ep, name) if name in EpisodeEvent.model_fields and name != "generation" else \
            _field(ep.generation, name)
        assert _same(row[name], want), name


def test_every_reward_column_is_the_decoded_events_field():
    raw = encode(REWARD)
    rw = decode(RewardEvent, raw)
    stamps, table = reward_table([raw])
    row = table.to_pylist()[0]
    assert stamps == [rw.labeled_at]
    derived = {"completion_tokens": len(rw.completion_token_ids)}
    for name in REWARD_SCHEMA.names:
        want = derived[name] if name in derived else _field(rw, name)
        got = dict(row[name]) if name == "components" else row[name]
        assert _same(got, want), name


@pytest.mark.parametrize("path", ["row", "table"])
def test_an_episode_recorded_before_api_key_id_archives_it_as_null(path):
    import json

    old = json.loads(encode(EPISODE))
    del old["generation"]["api_key_id"]
    raw = json.dumps(old, separators=(",", ":")).encode()
    row = episode_row(raw)[1] if path == "row" else episode_table([raw])[1].to_pylist()[0]
    assert row["api_key_id"] is None and row["generation_id"] == "g1" and row["prompt_token_ids"] == [3, 4]

