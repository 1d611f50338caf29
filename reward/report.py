"""``flywheel reward report``: summary tables of the rewards archive, with pandas.

Reads ``<data_dir>/archive/rewards`` (Parquet, partitioned by hour) and prints the reward
distribution by model version, by signal and by guard flag, and the users with the most samples
flagged by the abuse guards (the users who sent the signals, as the guards judged them). Run
``flywheel reward report [--archive DIR] [--top N]``.

A generation is counted once, by its last reward: one labeled again (an episode replayed after
``reward.dedupe_retention_s``, when the stage no longer remembers it) has a row per labeling in
the archive, and the report sets the earlier ones aside and says how many.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pyarrow as pa

from flywheel.contracts import ABUSE_FLAGS
from flywheel.stream.archive import read_schema

if TYPE_CHECKING:  # pandas is imported by the report only: the stage starts faster without it
    import pandas as pd

REWARD_SCHEMA = pa.schema([
    pa.field("generation_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string()),
    pa.field("user_id", pa.string()),
    pa.field("rater_id", pa.string()),
    pa.field("model_version", pa.int64()),
    pa.field("signal", pa.string()),
    pa.field("reward", pa.float64()),
    pa.field("weight", pa.float64()),
    pa.field("flags", pa.list_(pa.string())),
    pa.field("components", pa.map_(pa.string(), pa.float64())),
    pa.field("completion_tokens", pa.int32()),
    pa.field("generated_at", pa.float64()),
    pa.field("labeled_at", pa.float64()),
])


class _RewardColumns(msgspec.Struct):
    """The fields of a reward record the archive keeps; msgspec skips the rest unparsed."""

    generation_id: str
    group_id: str
    user_id: str
    model_version: int
    signal: str
    reward: float
    weight: float
    flags: list[str]
    components: dict[str, float]
    completion_token_ids: list[int]
    generated_at: float
    labeled_at: float
    rater_id: str | None = None


# Plain typed parsing, not ``RewardEvent`` validation: the archive only sees outbox rows the
# stage itself encoded from a validated episode, so validating again would only cost time.
_decode_rewards = msgspec.json.Decoder(list[_RewardColumns])


def reward_row(value: bytes) -> tuple[float, dict[str, object]]:
    """A reward record as an archive row, filed under the hour it was labeled (the archive's
    per-record path; the stage's records always take :func:`reward_table`)."""
    stamps, table = reward_table([value])
    return stamps[0], table.to_pylist()[0]


def reward_table(values: list[bytes]) -> tuple[list[float], pa.Table]:
    """Reward records as archive rows: one parse of the whole batch and one column per field,
    about half the cost of building a dict per row."""
    rs = _decode_rewards.decode(b"[" + b",".join(values) + b"]")
    stamps = [r.labeled_at for r in rs]
    table = pa.Table.from_pydict({
        "generation_id": [r.generation_id for r in rs], "group_id": [r.group_id for r in rs],
        "user_id": [r.user_id for r in rs], "rater_id": [r.rater_id for r in rs],
        "model_version": [r.model_version for r in rs],
        "signal": [r.signal for r in rs], "reward": [r.reward for r in rs],
        "weight": [r.weight for r in rs], "flags": [r.flags for r in rs],
        "components": [list(r.components.items()) for r in rs],
        "completion_tokens": [len(r.completion_token_ids) for r in rs],
        "generated_at": [r.generated_at for r in rs], "labeled_at": stamps,
    }, schema=REWARD_SCHEMA)
    return stamps, table


def _dist(df: pd.DataFrame, by: str) -> pd.DataFrame:
    return df.groupby(by).agg(
        samples=("reward", "size"), mean=("reward", "mean"), std=("reward", "std"),
        min=("reward", "min"), median=("reward", "median"), max=("reward", "max"),
        mean_weight=("weight", "mean"),
    ).round(4)


def latest_rewards(df: pd.DataFrame) -> pd.DataFrame:
    """One row per generation: its last reward, by ``labeled_at`` (then ``outbox_seq``, which
    orders the rows one store wrote), the rows of its earlier labelings set aside."""
    if df["generation_id"].is_unique:  # the usual archive: no sort to pay for
        return df
    order = [c for c in ("labeled_at", "outbox_seq") if c in df]
    return df.sort_values(order, kind="stable", na_position="first").drop_duplicates("generation_id", keep="last")


def summarise(df: pd.DataFrame, top: int = 10) -> dict[str, pd.DataFrame]:
    """The report's tables, keyed by title (pure: a DataFrame in, DataFrames out), each
    generation counted once (:func:`latest_rewards`)."""
    df = latest_rewards(df)
    # a sample's user is whoever sent its signal, as the guards judged it; rows written before
    # rewards carried ``rater_id`` have none: their raters were the generations' users
    rater = df["rater_id"].fillna(df["user_id"]) if "rater_id" in df else df["user_id"]
    df = df.assign(user=rater)
    flags = df.assign(flag=df["flags"].map(lambda f: list(f) if len(f) else ["none"])).explode("flag")
    # users are ranked by what the abuse guards said of them; long and repetition judge the
    # completion the model wrote, not the user who rated it
    flagged = flags[flags["flag"].isin(ABUSE_FLAGS)]
    users = (
        flagged.groupby("user")
        .agg(flagged=("generation_id", "nunique"), flags=("flag", lambda s: ",".join(sorted(set(s)))))
        .join(df.groupby("user").agg(samples=("reward", "size"), mean_weight=("weight", "mean")))
        .sort_values(["flagged", "samples"], ascending=False)
        .head(top)
    )
    return {
        "reward by model version": _dist(df, "model_version"),
        "reward by signal": _dist(df, "signal"),
        "reward by guard flag": _dist(flags, "flag"),
        f"top {top} flagged users": users.round(4),
    }


def read_rewards(archive: Path) -> pd.DataFrame:
    """The whole archive, every column of the current schema (files older than a column read
    as nulls in it, not as the column missing from every row)."""
    import pandas as pd

    return pd.read_parquet(archive, schema=read_schema(REWARD_SCHEMA))


def _read(archive: Path) -> tuple[pd.DataFrame, int] | None:
    """The archive's latest rewards and how many repeated rows were set aside; None: no archive."""
    if not archive.exists() or not any(archive.glob("hour=*/*.parquet")):
        return None
    every = read_rewards(archive)
    df = latest_rewards(every)
    return df, len(every) - len(df)


#: ``-o json``'s key for each of :func:`summarise`'s tables, in its order (the titles are for people).
JSON_TABLES = ("by_model_version", "by_signal", "by_guard_flag", "flagged_users")


def report_json(archive: Path, top: int = 10) -> dict[str, Any]:
    """``flywheel reward report -o json`` (flywheel/output.py): ``archive``, ``rewards``,
    ``repeated`` and, per :data:`JSON_TABLES`, the table's rows, each with its key column
    (``model_version``, ``signal``, ``flag``, ``user``) and the numbers (``samples``, ``mean``,
    ``std``, ``min``, ``median``, ``max``, ``mean_weight``; the users' ``flagged``, ``flags``,
    ``samples``, ``mean_weight``). A number pandas has none for (one sample's std) is null."""
    found = _read(archive)
    body: dict[str, Any] = {"archive": str(archive), "rewards": 0, "repeated": 0} | {k: [] for k in JSON_TABLES}
    if found is None:
        return body
    df, repeated = found
    body.update(rewards=len(df), repeated=repeated)
    for key, table in zip(JSON_TABLES, summarise(df, top).values(), strict=True):
        rows = table.reset_index().to_dict("records")
        body[key] = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
    return body


def report(archive: Path, top: int = 10) -> str:
    found = _read(archive)
    if found is None:
        return f"no reward archive at {archive}"
    df, repeated = found
    parts = [f"{len(df)} rewards in {archive}"]
    if repeated:
        parts.append(f"{repeated} repeated rows set aside: generations labeled again (after "
                     "reward.dedupe_retention_s) count once, by their last reward")
    for title, table in summarise(df, top).items():
        parts.append(f"\n== {title} ==\n{table.to_string() if len(table) else '(none)'}")
    return "\n".join(parts)
