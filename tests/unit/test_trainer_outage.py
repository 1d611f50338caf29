"""The trainer's wait for a checkpoint store out of reach: what counts as an outage, its backoff,
its one log line, and its clock (trainer/outage.py, CheckpointStore.out_of_reach)."""

from __future__ import annotations

import errno
import logging

import pytest

from flywheel.checkpoints import CheckpointStore, ManifestError
from trainer.outage import FIRST_PAUSE_S, MAX_PAUSE_S, START_WAIT_S, StoreOutage, StoreOutOfReach


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("exc, away", [
    (PermissionError(errno.EACCES, "Permission denied"), True),
    (OSError(errno.ESTALE, "Stale file handle"), True),
    (OSError(errno.EIO, "Input/output error"), True),
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (FileNotFoundError(errno.ENOENT, "No such file"), False),  # a file the store should hold: broken
    (ManifestError("v00000003 has no flywheel-manifest.json"), False),
    (RuntimeError("File cannot be opened"), False),  # wrapped, while the store answers
])
def test_out_of_reach_is_an_errno_that_says_not_now(tmp_path, exc, away):
    store = CheckpointStore(tmp_path / "store")
    assert (store.out_of_reach(exc) is exc) is away


def test_out_of_reach_asks_the_store_when_a_library_wrapped_the_error(tmp_path):
    """A RuntimeError from torch's writer says nothing of the cause: listing the root does."""
    store = CheckpointStore(tmp_path / "store")
    store.root.rmdir()
    store.root.write_text("not a directory")  # ENOTDIR: a broken store, not one away
    assert store.out_of_reach(RuntimeError("File cannot be opened")) is None


def test_backoff_doubles_to_its_cap_and_is_logged_once_per_outage(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="trainer.outage")
    clock = Clock()
    out = StoreOutage(CheckpointStore(tmp_path), clock)
    assert not out.waiting() and out.stalled_s() == 0
    err = PermissionError(errno.EACCES, "Permission denied")
    pauses = []
    for _ in range(8):
        out.failed("staging version 3", err)
        assert out.waiting()
        pauses.append(out.wait_s())
        clock.now += out.wait_s()
        assert not out.waiting()  # the next try is due
    assert pauses[0] == FIRST_PAUSE_S and pauses[1] == 2 * FIRST_PAUSE_S and pauses[-1] == MAX_PAUSE_S
    assert out.stalled_s() == pytest.approx(sum(pauses))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "out of reach" in warnings[0].getMessage()
    assert "staging version 3" in warnings[0].getMessage()

    out.ok()
    assert out.stalled_s() == 0 and not out.waiting()
    assert sum("is back after" in r.getMessage() for r in caplog.records) == 1
    out.ok()  # a try that went through with no outage says nothing
    assert sum("is back after" in r.getMessage() for r in caplog.records) == 1

    out.failed("announcing version 4", err)  # a new outage starts again from the first pause
    assert out.wait_s() == FIRST_PAUSE_S
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2


def test_a_start_gives_up_on_a_store_away_past_its_wait_naming_it(tmp_path):
    clock = Clock()
    out = StoreOutage(CheckpointStore(tmp_path / "store"), clock)
    out.failed("reading its versions", PermissionError(errno.EACCES, "Permission denied"))
    clock.now += START_WAIT_S - 5 * MAX_PAUSE_S
    out.failed("reading its versions", PermissionError(errno.EACCES, "Permission denied"))
    out.start_pause()  # within the wait: sleeps until the next try (a second)
    clock.now += 5 * MAX_PAUSE_S + 1
    with pytest.raises(StoreOutOfReach, match=r"checkpoint store .*store has been out of reach for 30\ds at start"):
        out.start_pause()


def test_the_outage_log_names_the_path_that_failed(tmp_path, caplog):
    """An error on any path counts (the model directory's files are copied into each version too):
    the runbook has the operator check the path, so the one line names it, not only the root."""
    caplog.set_level(logging.WARNING, logger="trainer.outage")
    out = StoreOutage(CheckpointStore(tmp_path / "store"), Clock())
    out.failed("writing version 3", PermissionError(errno.EACCES, "Permission denied", "/models/base/config.json"))
    (warning,) = caplog.records
    assert "/models/base/config.json" in warning.getMessage() and "Permission denied" in warning.getMessage()
