"""The trainer waits out a checkpoint store it cannot read or write, and loses nothing.

The trainer runs as a real subprocess (``python -m trainer``, DeepSpeed on the CPU) against the
session's broker. Once it has published versions, its store's directory is made ``chmod 000``
(what the whole-loop fault run does, bench/chaos.py ``store_unreadable``), more rewards arrive,
and a version comes due that cannot be written. The process must stay up, say so once, count the
wait in ``trainer_stalled_seconds`` and commit no group offset of work that is in no version;
once the mode is restored the version goes out, verifies against its manifest, and the ledgers
list every sample exactly once.

Root ignores file modes (CAP_DAC_OVERRIDE), and the tests run as root: the trainer then runs
under ``setpriv`` without that capability, as bench/chaos.py runs ``flywheel up``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import PYTHON, ROOT, send_rewards, trainer_env

from flywheel.checkpoints import CheckpointStore
from flywheel.checkpoints.manifest import MANIFEST_NAME, sha256_file
from flywheel.contracts import CheckpointEvent, decode
from tests.conftest import read_all

pytestmark = pytest.mark.integration

#: Longer than several of the trainer's retries, shorter than chaos's 10-30 s to keep the test short.
OUTAGE_S = 8.0
#: capabilities that let root read and write whatever the modes say (bench/chaos.py drops the same)
DROP = "-dac_override,-dac_read_search"


def trainer_argv() -> list[str]:
    argv = [PYTHON, "-m", "trainer"]
    if os.geteuid() != 0:
        return argv  # the mode binds already
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: chmod 000 would not bind the trainer")
    return ["setpriv", "--bounding-set", DROP, "--inh-caps", DROP, "--", *argv]


def metric(log: Path, name: str) -> float | None:
    ports = re.findall(r"trainer ops on [\d.]+:(\d+)", log.read_text(errors="replace"))
    if not ports:
        return None
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{ports[-1]}/metrics", timeout=2).read().decode()
    except OSError:  # a process that went away: the caller's wait_for says how
        return None
    return float(re.search(rf"^{name} (\S+)$", body, re.MULTILINE).group(1))


def trained(store: Path) -> list[str]:
    return [g for d in sorted(store.glob("v*")) for g in CheckpointStore(store).ledger(int(d.name[1:]))["trained"]]


def committed(kafka_settings, group: str, topic: str) -> int:
    """The trainer's group offsets on ``topic``, summed over partitions (its monitoring commits)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap)
    try:
        offsets = admin.list_group_offsets({group: None}).get(group, {})
        return sum(m.offset for tp, m in offsets.items() if tp.topic == topic)
    finally:
        admin.close()


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited with {proc.returncode} while waiting for {what}:\n"
                                 + log.read_text(errors="replace")[-3000:])
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# slow: about 25 s of a trainer subprocess on 2 cores, and the default suite must stay under 14
# minutes; which errors are an outage, the backoff and the one log line per outage are unit tests
# (tests/unit/test_trainer_outage.py) in the default suite
@pytest.mark.slow
def test_an_unreadable_store_is_waited_out_and_the_next_version_verifies(kafka_settings, topics, tiny_model_dir,
                                                                         tmp_path):
    argv = trainer_argv()
    before, during = range(16), range(16, 32)
    send_rewards(kafka_settings, topics.rewards, before)
    store = tmp_path / "data" / "checkpoints"
    group = f"{topics.prefix}trainer"
    env = trainer_env(kafka_settings, topics.prefix, tiny_model_dir, tmp_path / "data", loss="reinforce",
                      batch_size=4, publish_every_steps=2, publish_every_s=1.0, max_seq_len=256, group_id=group)
    log = tmp_path / "trainer.log"
    proc = subprocess.Popen(argv, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)
    mode = None
    try:
        wait_for(lambda: len(trained(store)) == len(before), 120, "the first records in versions", proc, log)
        wait_for(lambda: committed(kafka_settings, group, topics.rewards) == len(before), 30,
                 "the group offsets of the first versions", proc, log)
        published = len(list(store.glob("v*")))
        # every announcement acked and marked: the store's next use is the publish of a version
        wait_for(lambda: (store / "announced").read_text() == str(published - 1), 30, "the announced mark",
                 proc, log)

        mode = store.stat().st_mode & 0o7777
        store.chmod(0)
        send_rewards(kafka_settings, topics.rewards, during)  # a version comes due that cannot be written
        end = time.monotonic() + OUTAGE_S
        wait_for(lambda: (metric(log, "trainer_stalled_seconds") or 0) > 1.0, OUTAGE_S, "the wait counted",
                 proc, log)
        wait_for(lambda: time.monotonic() > end, OUTAGE_S + 1, "the outage's end", proc, log)
        assert committed(kafka_settings, group, topics.rewards) == len(before), \
            "group offsets moved past work that is in no version"
        store.chmod(mode)
        mode = None

        wait_for(lambda: len(trained(store)) == len(before) + len(during), 60, "the rest in versions", proc, log)
        wait_for(lambda: metric(log, "trainer_stalled_seconds") == 0, 10, "the stall clock back at 0", proc, log)
        assert proc.poll() is None
    finally:
        if mode is not None:
            store.chmod(mode)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, log.read_text(errors="replace")[-3000:]

    ids = trained(store)
    assert sorted(ids) == sorted(f"gen-{i}" for i in [*before, *during])  # each exactly once
    versions = sorted(int(d.name[1:]) for d in store.glob("v*"))
    assert versions == list(range(len(versions))) and len(versions) > published
    CheckpointStore(store).materialize(versions[-1])  # the chain verifies against the manifests
    assert not list(store.glob(".tmp-*")), "a failed publish left its staging directory"
    text = log.read_text(errors="replace")
    assert text.count("is out of reach") == 1, "one line per outage, not per try"
    assert f"while staging version {published}" in text  # the publish was what waited
    assert "checkpoint store is back" in text
    events = [decode(CheckpointEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.checkpoints,
                                                                   expect=len(versions))]
    assert sorted({e.version for e in events}) == versions
    for e in events:
        assert e.manifest_sha256 == sha256_file(store / f"v{e.version:08d}" / MANIFEST_NAME)
