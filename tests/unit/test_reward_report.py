"""`flywheel reward report`: the summary tables read back from a real Parquet archive."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from flywheel.contracts import RewardEvent, SamplingParams, encode
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.store import ArchiveRow
from reward.report import REWARD_SCHEMA, read_rewards, report, reward_row, reward_table, summarise


def reward(i: int, user: str, signal: str, value: float, flags=(), version=0, rater=None) -> RewardEvent:
    return RewardEvent(
        generation_id=f"g{i}", group_id="grp", user_id=user, rater_id=rater, model_version=version, signal=signal,
        prompt_token_ids=(1,), completion_token_ids=(2, 3), logprobs=(-1.0, -1.0),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), reward=value,
        components={"signal": value}, weight=0.2 if flags else 1.0, flags=flags,
        generated_at=1.7e9, labeled_at=1.7e9 + 3600 * (i % 2))


def test_report_tables_from_archive(tmp_path):
    events = [reward(0, "a", "accept", 0.75), reward(1, "a", "reject", -0.25, version=1),
              reward(2, "b", "accept", 0.75, ("constant_user",)), reward(3, "b", "accept", 0.25, ("constant_user", "long"))]
    arch = ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row)
    arch.write("e0", [ArchiveRow(i, "rewards", encode(e)) for i, e in enumerate(events)])
    df = pd.read_parquet(tmp_path)
    assert len(df) == 4 and set(df["hour"].astype(str)) == {"2023-11-14T22", "2023-11-14T23"}
    tables = summarise(df)
    assert tables["reward by model version"].loc[1, "samples"] == 1
    assert tables["reward by signal"].loc["accept", "mean"] == round((0.75 + 0.75 + 0.25) / 3, 4)
    by_flag = tables["reward by guard flag"]
    assert by_flag.loc["constant_user", "samples"] == 2 and by_flag.loc["none", "samples"] == 2
    users = tables["top 10 flagged users"]
    assert list(users.index) == ["b"] and users.loc["b", "flagged"] == 2
    text = report(tmp_path)
    assert "4 rewards" in text and "== reward by guard flag ==" in text and "constant_user" in text


def test_archive_rows_hold_the_reward_fields_on_both_paths(tmp_path):
    events = [reward(0, "a", "edit", 0.5), reward(1, "b", "accept", 0.75, ("constant_user", "long"), rater="r"),
              reward(2, "c", "reject", -0.25, version=3)]
    rows = [ArchiveRow(7 + i, "rewards", encode(e)) for i, e in enumerate(events)]
    for name, table_fn in (("batch", reward_table), ("row", None)):
        ParquetArchive(tmp_path / name, REWARD_SCHEMA, reward_row, table_fn).write("e0", rows)
        got = pd.read_parquet(tmp_path / name).sort_values("outbox_seq")
        assert list(got["outbox_seq"]) == [7, 8, 9]
        for (_, row), e in zip(got.iterrows(), events):
            assert (row["generation_id"], row["user_id"], row["model_version"], row["signal"]) == (
                e.generation_id, e.user_id, e.model_version, e.signal)
            assert (row["reward"], row["weight"], tuple(row["flags"])) == (e.reward, e.weight, e.flags)
            assert dict(row["components"]) == e.components and row["completion_tokens"] == 2
            assert (row["generated_at"], row["labeled_at"]) == (e.generated_at, e.labeled_at)
        assert got["rater_id"].fillna("-").tolist() == ["-", "r", "-"]


def test_flagged_users_are_the_raters_the_guards_judged(tmp_path):
    """One account rating other users' generations is the flagged user, not those users. An
    archive written before rewards carried ``rater_id`` still reports, by generation user."""
    events = [reward(i, f"owner{i}", "accept", 0.75, ("constant_user",), rater="rater") for i in range(3)]
    events.append(reward(3, "d", "accept", 0.75, ("user_cap",)))  # no rater: the generation's user
    ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row).write("e0", [ArchiveRow(i, "rewards", encode(e))
                                                                     for i, e in enumerate(events)])
    users = summarise(read_rewards(tmp_path))["top 10 flagged users"]
    assert list(users.index) == ["rater", "d"] and list(users["flagged"]) == [3, 1]
    old = summarise(read_rewards(tmp_path).drop(columns="rater_id"))["top 10 flagged users"]
    assert sorted(old.index) == ["d", "owner0", "owner1", "owner2"]


def test_files_from_before_rater_id_read_with_the_newer_ones(tmp_path):
    """An archive upgraded in place: its oldest hour lacks the column. Read by the first file's
    columns, every row lost its rater; read by the schema, only the old rows have none."""
    import pyarrow.parquet as pq

    new = [reward(i, f"owner{i}", "accept", 0.75, ("constant_user",), rater="rater") for i in range(2)]
    ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row).write("e1", [ArchiveRow(10 + i, "rewards", encode(e))
                                                                     for i, e in enumerate(new)])
    _, table = reward_table([encode(reward(9, "d", "accept", 0.75, ("user_cap",)))])
    old_hour = tmp_path / "hour=2000-01-01T00"
    old_hour.mkdir()
    pq.write_table(table.drop_columns(["rater_id"]).append_column("outbox_seq", pa.array([1], pa.int64())),
                   old_hour / "part-e0-000000000001-000000000001.parquet")
    assert "rater_id" not in pd.read_parquet(tmp_path)  # what a schema-less read does
    df = read_rewards(tmp_path)
    assert len(df) == 3 and df["rater_id"].fillna("-").tolist() == ["-", "rater", "rater"]
    users = summarise(df)["top 10 flagged users"]
    assert list(users.index) == ["rater", "d"]


def test_report_without_archive(tmp_path):
    assert "no reward archive" in report(tmp_path / "missing")


def test_flagged_users_are_ranked_by_abuse_flags_only(tmp_path):
    """``long`` and ``repetition`` judge the completion the model wrote: a user who asks for
    essays is not an abuser, and must not push one off the table the abuse runbook reads."""
    events = [reward(i, "asks_for_essays", "accept", 0.65, ("long",)) for i in range(30)]
    events += [reward(30 + i, "flooder", "accept", 0.75, ("user_cap", "rate_anomaly")) for i in range(20)]
    ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row).write("e0", [ArchiveRow(i, "rewards", encode(e))
                                                                     for i, e in enumerate(events)])
    tables = summarise(read_rewards(tmp_path), top=1)
    users = tables["top 1 flagged users"]
    assert list(users.index) == ["flooder"] and users.loc["flooder", "flags"] == "rate_anomaly,user_cap"
    assert tables["reward by guard flag"].loc["long", "samples"] == 30  # still reported, by flag


def test_the_report_refuses_a_negative_top():
    from cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["reward", "report", "--top", "-1"])
    assert exc.value.code == 2
    assert build_parser().parse_args(["reward", "report", "--top", "0"]).top == 0


def test_a_generation_labeled_again_counts_once_by_its_last_reward(tmp_path):
    """An episode replayed after ``reward.dedupe_retention_s`` is labeled again: the archive
    holds both rewards. Counted twice, its user had 3 samples of which 1 flagged (flagged counts
    generations, samples counted rows), and its signal the stale reward too."""
    first = reward(1, "b", "accept", 0.75, ("constant_user",)).model_copy(update={"labeled_at": 1.7e9})
    again = first.model_copy(update={"labeled_at": 1.7e9 + 2 * 86400, "reward": 0.25,
                                     "components": {"signal": 0.25}})
    other = reward(2, "b", "reject", -0.25)
    # the later labeling written first (a lower outbox_seq, as after a store was rebuilt):
    # the last reward is the last labeled
    ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row).write(
        "e0", [ArchiveRow(i, "rewards", encode(e)) for i, e in enumerate([again, other, first])])
    tables = summarise(read_rewards(tmp_path))
    users = tables["top 10 flagged users"]
    assert (users.loc["b", "flagged"], users.loc["b", "samples"]) == (1, 2)
    by_signal = tables["reward by signal"]
    assert (by_signal.loc["accept", "samples"], by_signal.loc["accept", "mean"]) == (1, 0.25)
    assert tables["reward by guard flag"].loc["constant_user", "samples"] == 1
    lines = report(tmp_path).splitlines()
    assert lines[:2] == [f"2 rewards in {tmp_path}",
                         ("1 repeated rows set aside: generations labeled again (after "
                          "reward.dedupe_retention_s) count once, by their last reward")]


def test_a_report_without_repeats_says_nothing_of_them(tmp_path):
    ParquetArchive(tmp_path, REWARD_SCHEMA, reward_row).write(
        "e0", [ArchiveRow(i, "rewards", encode(reward(i, "a", "accept", 0.75))) for i in range(3)])
    assert report(tmp_path).splitlines()[:2] == [f"3 rewards in {tmp_path}", ""]


def test_the_report_command_reads_the_archive_under_the_data_dir(tmp_path, monkeypatch, capsys):
    """`flywheel reward report` with no --archive reads <data_dir>/archive/rewards, where the
    stage writes it, and prints the tables."""
    from cli.main import main as cli_main

    events = [reward(0, "a", "accept", 0.75), reward(1, "b", "reject", -0.25, ("constant_user",))]
    ParquetArchive(tmp_path / "archive" / "rewards", REWARD_SCHEMA, reward_row, reward_table).write(
        "e0", [ArchiveRow(i, "rewards", encode(e)) for i, e in enumerate(events)])
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))
    assert cli_main(["reward", "report", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 rewards in {tmp_path / 'archive' / 'rewards'}")
    assert "== top 1 flagged users ==" in out and "constant_user" in out


def test_the_report_command_prints_one_json_object_with_o_json(tmp_path, monkeypatch, capsys):
    """`flywheel reward report -o json`: the same tables under stable keys, each row with its
    key column, one object on one line (a std pandas has none for, one sample's, is null)."""
    import json

    from cli.main import main as cli_main

    events = [reward(0, "a", "accept", 0.75), reward(1, "b", "reject", -0.25, ("constant_user",), version=1),
              reward(2, "a", "accept", 0.25)]
    archive = tmp_path / "archive" / "rewards"
    ParquetArchive(archive, REWARD_SCHEMA, reward_row, reward_table).write(
        "e0", [ArchiveRow(i, "rewards", encode(e)) for i, e in enumerate(events)])
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))
    assert cli_main(["reward", "report", "-o", "json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "NaN" not in out
    body = json.loads(out)
    assert (body["archive"], body["rewards"], body["repeated"]) == (str(archive), 3, 0)
    by_version = {r["model_version"]: r for r in body["by_model_version"]}
    assert by_version[0]["samples"] == 2 and by_version[0]["mean"] == 0.5 and by_version[1]["std"] is None
    assert {r["signal"]: r["samples"] for r in body["by_signal"]} == {"accept": 2, "reject": 1}
    assert {r["flag"] for r in body["by_guard_flag"]} == {"none", "constant_user"}
    assert [(u["user"], u["flagged"], u["flags"]) for u in body["flagged_users"]] == [("b", 1, "constant_user")]

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "nothing"))
    assert cli_main(["reward", "report", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["rewards"] == 0
