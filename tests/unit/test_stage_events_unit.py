"""Operational events met by a stage's own files (no broker): a restart on its data_dir with changed
settings, where what the store holds must still mean what the new settings take it to mean, and an
archive disk that fills up or a write cut short by a kill."""

from __future__ import annotations

from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry

from flywheel.contracts import (
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)
from flywheel.settings import RewardSettings
from flywheel.stream.store import StateStore
from reward.stage import SCHEMA, RewardStage

LIVE = 1_800_000_000.0  # the wall clock in these tests (3600 divides it)
GUARDS = RewardSettings(user_cap_share=0.2, user_cap_min=5, constant_min_signals=4, rate_factor=3.0, rate_min=10)


def _episodes(n: int, created_at: float, start: int = 0) -> list[ConsumerRecord]:
    """``n`` episodes generated at ``created_at`` on shard 0, every other one the flooder's."""
    out = []
    for i in range(start, start + n):
        g = GenerationEvent(
            generation_id=f"g{i}", group_id=f"g{i}", model_name="m", model_version=0,
            user_id="flood" if i % 2 else f"u{i % 5}", endpoint="chat", created_at=created_at,
            completed_at=created_at, latency_ms=1, prompt_text="p", prompt_token_ids=(1,), completion_text="c",
            completion_token_ids=(1, 2, 3), logprobs=(-1.0, -1.0, -1.0),
            sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")
        value = encode(EpisodeEvent(generation=g, signal=("accept", "reject")[i % 3 == 0], resolved_at=created_at))
        out.append(ConsumerRecord(topic="t.episodes", partition=0, leader_epoch=-1, offset=i, timestamp=0,
                                  timestamp_type=0, key=g.generation_id.encode(), value=value, headers=[],
                                  checksum=None, serialized_key_size=0, serialized_value_size=len(value),
                                  serialized_header_size=0))
    return out


def _stage(path, cfg: RewardSettings) -> tuple[StateStore, RewardStage]:
    store = StateStore(path, SCHEMA)
    return store, RewardStage(cfg, Topics("t."), store, CollectorRegistry())


def _capped(store: StateStore) -> int:
    rewards = [decode(RewardEvent, r.value) for r in store.pending([0], limit=10**6) if r.topic == "t.rewards"]
    return sum("user_cap" in r.flags for r in rewards)


def _flood(store: StateStore, stage: RewardStage, start: float) -> None:
    """200 live episodes in ten turns a minute apart, each turn followed by its tick (a prune)."""
    for i in range(10):
        now = start + 61 * i
        with store.txn():
            stage.process(_episodes(20, now, start=1000 + 20 * i), now)
            stage.tick({0}, now)


def test_widening_the_guard_window_on_a_data_dir_keeps_the_guards_counting(tmp_path):
    """``reward.guard_window_s`` raised from a minute to an hour on a running deployment: the
    store's guard windows and each shard's ``reached`` window are numbers in the old unit (60x
    the new ones). Taken as they are, the shard looks sixty times further on than it is, and
    every prune (once a minute) deletes the counts of the windows it is filling: a flooder's
    share restarts every minute and the share cap never binds. The counts must be judged in one
    unit, as on a fresh store."""
    minute = GUARDS.model_copy(update={"guard_window_s": 60.0})
    hour = GUARDS.model_copy(update={"guard_window_s": 3600.0})
    store, stage = _stage(tmp_path / "a" / "s.sqlite3", minute)
    with store.txn():
        stage.process(_episodes(4, LIVE - 30), LIVE - 30)
    store.close()

    store, stage = _stage(tmp_path / "a" / "s.sqlite3", hour)  # restarted with the wider window
    store.db.execute("DELETE FROM outbox")  # (the earlier run's rewards, delivered meanwhile)
    _flood(store, stage, LIVE + 60)
    widened = _capped(store)
    windows = sorted({w for (w,) in store.db.execute("SELECT win FROM user_win")})
    store.close()

    store, stage = _stage(tmp_path / "b" / "s.sqlite3", hour)  # the same traffic on a fresh store
    _flood(store, stage, LIVE + 60)
    fresh = _capped(store)
    store.close()
    assert fresh >= 50  # the cap binds on the flooder within the hour
    assert int((LIVE + 60) // 3600) in windows and widened == fresh, (
        f"after widening guard_window_s the flooder was capped {widened} times, on a fresh store {fresh}; "
        f"guard windows left in the store: {windows}")


# -- the archive's disk full ----------------------------------------------------------------------
def test_an_archive_write_the_disk_refuses_leaves_no_partial_file_behind(tmp_path, monkeypatch):
    """The archive's disk fills up in the middle of a Parquet write (ENOSPC). The stage stops and
    its supervisor restarts it; each try writes the queue's file again until the disk is full.
    A try must not leave its partial temporary file behind: those pile up unseen (hidden names,
    no reader lists them), each taking whatever space the operator freed since the last try, so
    the disk never comes back. Once space is there, the rows are archived once."""
    import errno

    import pyarrow as pa
    import pytest

    from flywheel.stream import archive as archive_mod
    from flywheel.stream.archive import ParquetArchive
    from flywheel.stream.outbox import Outbox

    def parquet(shared: bool = True) -> ParquetArchive:
        return ParquetArchive(tmp_path / "archive", pa.schema([pa.field("v", pa.string())]),
                              lambda v: (0.0, {"v": v.decode()}), shared=shared)

    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(30):
            store.append(0, "out", f"k{i}", f"v{i}".encode(), archive="a")
    real_write = archive_mod.pq.write_table

    def disk_full(table, where, **kw):
        with open(where, "wb") as fh:
            fh.write(b"PAR1" + b"\0" * 65536)  # as far as the disk took it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive_mod.pq, "write_table", disk_full)
    for _ in range(3):  # the stage and two restarts by its supervisor
        with pytest.raises(OSError):
            Outbox(store, None, {"a": parquet()}).archive(force=True)
    monkeypatch.setattr(archive_mod.pq, "write_table", real_write)  # the operator freed space
    assert Outbox(store, None, {"a": parquet()}).archive(force=True) == 30 and store.queued == 0
    left = sorted(p.name for p in (tmp_path / "archive").rglob("*") if p.is_file() and p.suffix != ".parquet")
    assert len(parquet().files()) == 1 and left == [], f"partial files left behind: {left}"
    store.close()


def test_a_partial_archive_file_left_by_a_kill_is_removed_when_the_stage_starts(tmp_path):
    """A ``kill -9`` in the middle of a Parquet write leaves its hidden temporary file: the next
    start removes it once it is stale, and keeps every finished file. A fresh one is kept on a
    root shared by replicas (another live replica's write in progress), and removed on a root of
    the process's own."""
    import os

    import pyarrow as pa

    from flywheel.stream.archive import STALE_TMP_S, ParquetArchive
    from flywheel.stream.store import ArchiveRow

    def parquet(shared: bool = True) -> ParquetArchive:
        return ParquetArchive(tmp_path / "archive", pa.schema([pa.field("v", pa.string())]),
                              lambda v: (0.0, {"v": v.decode()}), shared=shared)

    parquet().write("e0", [ArchiveRow(1, "a", b"x")])
    (finished,) = parquet().files()
    partial = finished.parent / f".{finished.name.replace('-000000000001.', '-000000000002.')}.0a1b2c3d.tmp"
    partial.write_bytes(b"PAR1" + b"\0" * 100)
    written = partial.stat().st_mtime - STALE_TMP_S - 1  # a write that died that long ago
    os.utime(partial, (written, written))
    live = finished.parent / f".{finished.name.replace('-000000000001.', '-000000000003.')}.9f8e7d6c.tmp"
    live.write_bytes(b"PAR1")  # another replica's, being written now
    other = finished.parent / "notes.txt"  # not the archive's: left alone
    other.write_text("kept")
    parquet()
    assert not partial.exists() and live.exists() and finished.exists() and other.exists()
    parquet(shared=False)  # a root of its own, under a locked data_dir: no write is in progress
    assert not live.exists() and finished.exists() and other.exists()
