"""The episode archive's columns: how an episode record becomes a row of its Parquet archive.

The archive itself (hourly files written atomically, read back with :func:`read_schema`) is the
stream runtime's (flywheel/stream/archive.py); this module only says what an episode row holds.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

EPISODE_SCHEMA = pa.schema([
    pa.field("generation_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string()),
    pa.field("choice_index", pa.int32()),
    pa.field("user_id", pa.string()),
    pa.field("model_name", pa.string()),
    pa.field("model_version", pa.int64()),
    pa.field("endpoint", pa.string()),
    pa.field("signal", pa.string(), nullable=False),
    pa.field("edited_text", pa.string()),
    pa.field("decision_ms", pa.float64()),
    pa.field("feedback_ids", pa.list_(pa.string())),
    pa.field("timed_out", pa.bool_()),
    pa.field("conflicted", pa.bool_()),
    pa.field("rater_id", pa.string()),
    pa.field("created_at", pa.float64()),
    pa.field("completed_at", pa.float64()),
    pa.field("resolved_at", pa.float64()),
    pa.field("latency_ms", pa.float64()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_text", pa.string()),
    pa.field("completion_text", pa.string()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("logprobs", pa.list_(pa.float32())),
    # added later (read older files with read_schema: they read as nulls): the API key's id
    pa.field("api_key_id", pa.string()),
])


def episode_row(value: bytes) -> tuple[float, dict[str, Any]]:
    """An episode record as an archive row, filed under the hour it was resolved."""
    ep = json.loads(value)
    g = ep["generation"]
    row = {k: g.get(k) for k in (
        "generation_id", "group_id", "choice_index", "user_id", "model_name", "model_version",
        "endpoint", "created_at", "completed_at", "latency_ms", "finish_reason", "prompt_text",
        "completion_text", "prompt_token_ids", "completion_token_ids", "logprobs", "api_key_id")}
    row.update({k: ep.get(k) for k in (
        "signal", "edited_text", "decision_ms", "feedback_ids", "timed_out", "conflicted", "rater_id",
        "resolved_at")})
    return ep["resolved_at"], row


_GEN_COLUMNS = ("generation_id", "group_id", "choice_index", "user_id", "model_name", "model_version",
                "endpoint", "created_at", "completed_at", "latency_ms", "finish_reason", "prompt_text",
                "completion_text", "prompt_token_ids", "completion_token_ids", "logprobs", "api_key_id")
_EPISODE_COLUMNS = ("signal", "edited_text", "decision_ms", "feedback_ids", "timed_out", "conflicted",
                    "rater_id", "resolved_at")
# Logprobs are read as doubles and rounded to float32 by a cast, as the row path's conversion of
# Python floats rounds them: Arrow's JSON reader parses the decimal text straight to float32, and
# for about half of the doubles halfway between two float32s lands one float32 step away.
_LOGPROBS_JSON = pa.field("logprobs", pa.list_(pa.float64()))


def _json_field(name: str) -> pa.Field:
    return _LOGPROBS_JSON if name == _LOGPROBS_JSON.name else EPISODE_SCHEMA.field(name)


# the episode record's shape, typed as the archive columns, for Arrow's JSON reader
_EPISODE_JSON = pa.schema(
    [pa.field("generation", pa.struct([_json_field(n) for n in _GEN_COLUMNS]))]
    + [_json_field(n) for n in _EPISODE_COLUMNS])


def episode_table(values: list[bytes]) -> tuple[list[float], pa.Table]:
    """:func:`episode_row` for a batch of one-line episode records, parsed by Arrow."""
    # Arrow parses in blocks (1 MiB by default) and refuses a record that spans more than two of
    # them: the block must be larger than the largest record (a valid episode can be several MiB).
    block = max(1 << 20, 2 * max(map(len, values), default=0))
    parsed = pj.read_json(io.BytesIO(b"\n".join(values)), read_options=pj.ReadOptions(block_size=block),
                          parse_options=pj.ParseOptions(explicit_schema=_EPISODE_JSON,
                                                        unexpected_field_behavior="ignore"))
    gen = parsed.column("generation")
    cols = {n: pc.struct_field(gen, n) for n in _GEN_COLUMNS}
    cols.update({n: parsed.column(n) for n in _EPISODE_COLUMNS})
    cols["logprobs"] = pc.cast(cols["logprobs"], EPISODE_SCHEMA.field("logprobs").type)
    table = pa.table([cols[f.name] for f in EPISODE_SCHEMA], schema=EPISODE_SCHEMA)
    return table.column("resolved_at").to_pylist(), table
