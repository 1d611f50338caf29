"""Who may run a stage's state store: the shards it is bound to, one live process at a time."""

from __future__ import annotations

import pytest

from flywheel.settings import SettingsError, load_settings
from ingest.exactly_once import ShardMismatch, StateStore
from ingest.runner import DataDirBusy, lock_data_dir


def test_store_keeps_the_shards_it_was_first_run_with(tmp_path):
    path = tmp_path / "s.sqlite3"
    store = StateStore(path)
    store.bind_shards((0, 2))
    store.close()
    again = StateStore(path)
    again.bind_shards((2, 0))  # the same set: fine
    with pytest.raises(ShardMismatch, match=r"holds the state of shards 0,2, but this process is configured for shards 1"):
        again.bind_shards((1,))
    with pytest.raises(ShardMismatch, match=r"configured for shards all \(consumer group\)"):
        again.bind_shards(())


def test_group_store_is_not_split_into_shards(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    store.bind_shards(())
    with pytest.raises(ShardMismatch, match=r"shards all \(consumer group\), but .* shards 0"):
        store.bind_shards((0,))


@pytest.mark.parametrize(("shards", "refused"), [((0, 1), False), ((0, 1, 2), False), ((0,), True)])
def test_store_from_before_shards_were_recorded(tmp_path, shards, refused):
    """Its offsets say which partitions it processed: a shard set leaving one out is refused."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        store.set_offsets({("t.generations", 0): 5, ("t.feedback", 1): 3})
    if refused:
        with pytest.raises(ShardMismatch, match=r"a set including \[1\]"):
            store.bind_shards(shards)
    else:
        store.bind_shards(shards)


def test_one_live_process_per_data_dir(tmp_path):
    first = lock_data_dir(tmp_path / "ingest", "ingest")
    with pytest.raises(DataDirBusy, match="another ingest process is running on"):
        lock_data_dir(tmp_path / "ingest", "ingest")
    lock_data_dir(tmp_path / "reward", "reward").close()  # another stage's folder is its own
    first.close()
    lock_data_dir(tmp_path / "ingest", "ingest").close()  # free again once the holder is gone


@pytest.mark.parametrize(("raw", "want"), [("1,0", (0, 1)), ("[3]", (3,)), ("", ())])
def test_shards_setting(raw, want):
    assert load_settings(env={"FLYWHEEL_INGEST_SHARDS": raw}).ingest.shards == want


@pytest.mark.parametrize(("raw", "msg"), [("1,1", "name a partition twice"), ("-1", "greater than or equal to 0")])
def test_bad_shards_setting(raw, msg):
    with pytest.raises(SettingsError, match=msg):
        load_settings(env={"FLYWHEEL_REWARD_SHARDS": raw})
