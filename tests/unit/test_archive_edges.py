"""Edges of the episode archive's two paths (ingest/archive.py, written through the runtime's
ParquetArchive, flywheel/stream/archive.py): the batch JSON reader must write what the row path
writes, and fall back to it where it refuses a record the row path takes."""

from __future__ import annotations

import json
import random
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flywheel.contracts import GenerationEvent, SamplingParams, encode
from flywheel.stream import archive
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.store import ArchiveRow
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from ingest.join import Resolution
from ingest.stage import episode_bytes

ACCEPT = Resolution(signal="accept", edited_text=None, decision_ms=None, feedback_ids=("f",), timed_out=False,
                    conflicted=False)


def generation(gid: str = "g", logprobs: tuple[float, ...] = (-0.5,)) -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id="grp", model_name="m", model_version=1, user_id="u", endpoint="chat",
        created_at=1700000000.0, completed_at=1700000001.0, latency_ms=5.0, prompt_text="p",
        prompt_token_ids=(1,), completion_text="c", completion_token_ids=(2,) * len(logprobs),
        logprobs=logprobs, sampling=SamplingParams(temperature=1, top_p=1, max_tokens=5), finish_reason="stop")


def as_float32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even), as Python sees it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def halfway_logprobs(n: int) -> tuple[float, ...]:
    """Doubles exactly halfway between two adjacent float32s: where parsing the text straight to
    float32 and rounding the double to float32 disagree."""
    rng = random.Random(1)
    fixed = (-(1 + 2**-24), -(1 + 3 * 2**-24), -1.5 * 2**-149)  # tie to even: down, up; subnormal
    drawn = tuple(-((2 * (rng.getrandbits(23) | 1 << 23) + 1) * 2.0 ** (rng.randint(-30, 10) - 24))
                  for _ in range(n))
    return fixed + drawn


def test_both_paths_round_halfway_logprobs_to_the_same_float32():
    values = halfway_logprobs(2000)
    raw = episode_bytes(encode(generation(logprobs=values)), ACCEPT, 1700000002.0)
    _, row = episode_row(raw)
    by_row = pa.Table.from_pylist([row], schema=EPISODE_SCHEMA)
    _, by_batch = episode_table([raw])
    assert by_batch.schema == EPISODE_SCHEMA
    assert by_batch.equals(by_row)
    got = by_batch.column("logprobs")[0].as_py()
    assert got[:3] == [-1.0, -(1 + 2**-22), -(2**-148)]
    assert got == [as_float32(v) for v in values]


def old_record(gid: str) -> bytes:
    """An episode whose generation an older version stored with ``choice_index`` as 1.0: the
    generation contract takes it, the row path writes it, Arrow's JSON reader refuses it."""
    stored = json.loads(encode(generation(gid)))
    stored["choice_index"] = 1.0
    return episode_bytes(json.dumps(stored).encode(), ACCEPT, 1700000002.0)


def test_a_chunk_the_batch_reader_refuses_is_written_by_the_row_path(tmp_path, monkeypatch):
    monkeypatch.setattr(archive, "TABLE_CHUNK", 2)
    good = [episode_bytes(encode(generation(f"g{i}")), ACCEPT, 1700000002.0) for i in range(2)]
    values = [*good, old_record("old"), good[0]]
    with pytest.raises(pa.ArrowInvalid):
        episode_table(values[2:])  # what failed every write of this queue before
    row_path: list[bytes] = []

    def row_fn(value: bytes):
        row_path.append(value)
        return episode_row(value)

    rows = [ArchiveRow(1 + i, "episodes", v) for i, v in enumerate(values)]
    fast = ParquetArchive(tmp_path / "fast", EPISODE_SCHEMA, row_fn, episode_table)
    fast.write("e", rows)
    assert row_path == values[2:]  # the second chunk only: the first still takes the batch reader
    slow = ParquetArchive(tmp_path / "slow", EPISODE_SCHEMA, episode_row)
    slow.write("e", rows)
    (written,), (expected,) = fast.files(), slow.files()
    assert written.name == expected.name and pq.read_table(written).equals(pq.read_table(expected))
    table = pq.read_table(written)
    assert table.column("choice_index").to_pylist() == [0, 0, 1, 0]
    assert table.column("outbox_seq").to_pylist() == [1, 2, 3, 4]


def test_a_record_the_row_path_refuses_too_fails_the_write_with_its_error(tmp_path):
    stored = json.loads(encode(generation("bad")))
    stored["choice_index"] = "first"
    value = episode_bytes(json.dumps(stored).encode(), ACCEPT, 1700000002.0)
    fast = ParquetArchive(tmp_path, EPISODE_SCHEMA, episode_row, episode_table)
    with pytest.raises(pa.ArrowInvalid, match="Could not convert 'first'"):
        fast.write("e", [ArchiveRow(1, "episodes", value)])
    assert fast.files() == []
