"""End to end: generations + feedback -> ingest -> reward on the real broker, exactly once.

The dataset is messy on purpose: shuffled order (feedback before its generation), duplicate
feedback and generations, conflicting signals, late feedback, orphans and malformed records. The
expected outcome is computed here from the documented rules (ingest/join.py, reward/labelers.py)
with an independent edit-distance implementation, then compared with the rewards topic, the
dead-letter topic and both Parquet archives. The second test runs each stage as a subprocess and
SIGKILLs them mid-stream several times: the outcome must be the same.

Random kills rarely land on the moments that need recovery, so the crash-point tests make a stage
kill itself exactly there (tests/integration/crashpoints/sitecustomize.py, loaded through the
child's PYTHONPATH; no product code is changed): after Kafka acked a batch's sends but before the
outbox knew, after archive files were renamed but before the queue was cleared, and during the
recovery scan itself. The restarted stage's log must show that recovery found work, and the
outcome must still be exact. A flooding user (half of all generations) checks the share cap on
the real broker: the flooder keeps exactly what reward/guards.py's ``within_cap`` allows.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from conftest import read_all
from conftest import stage_env as base_stage_env
from ingest.exactly_once import out_partition

from flywheel.contracts import (
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    decode,
    encode,
)
from flywheel.kafka.clients import make_producer
from flywheel.settings import RewardSettings, load_settings
from flywheel.stream.deadletters import DEADLETTER_PREFIX_BYTES
from ingest.stage import DEADLETTER_REASONS as INGEST_REASONS
from reward.guards import within_cap
from reward.stage import DEADLETTER_REASONS as REWARD_REASONS

pytestmark = pytest.mark.integration

WINDOW_S, GRACE_S = 2.0, 0.5
ACCEPT, REJECT, BONUS, REF_MS = 0.75, -0.25, 0.1, 10_000.0
REPEAT_PENALTY = 0.5
CONSTANT_USER, CONSTANT_MIN = "u-constant", 20
#: Four of the tests' consumer sessions (every group membership expires), and longer than a send
#: made early in the stall takes to fail (the stall test's 3 s delivery timeout, plus librdkafka's
#: once-a-second scan for timed-out sends).
STALL_S = 8.0
STALL_AFTER_CHUNK = 3
REPLAY_GAP_S = 1.0  # feedback behind its generation in a replay: longer than GRACE_S, within WINDOW_S
#: The flooding user of ``build_dataset(flood=True)``: every other generation, all of them rated.
#: A share this small never binds in these runs (check_flood asserts it): the cap is the minimum.
FLOOD_USER, FLOOD_CAP_SHARE = "u-flood", 0.02


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def expected_reward(signal: str, completion: str, edited: str | None, decision_ms: float, repetitive: bool) -> float:
    fade = BONUS * max(0.0, 1 - decision_ms / REF_MS)
    value = {"accept": ACCEPT + fade, "reject": REJECT - fade, "ignore": 0.0}.get(signal)
    if signal == "edit":
        sim = 1 - levenshtein(completion, edited) / max(len(completion), len(edited), 1)
        value = REJECT + (ACCEPT - REJECT) * sim
    return value - (REPEAT_PENALTY if repetitive else 0.0)


@dataclass
class Dataset:
    chunks: list[list[tuple[str, str | None, bytes]]] = field(default_factory=list)
    generations: set[str] = field(default_factory=set)
    rewards: dict[str, tuple[str, float, bool]] = field(default_factory=dict)  # gid -> signal, value, conflicted
    raters: dict[str, str] = field(default_factory=dict)  # gid -> the user whose signal won
    dead: Counter = field(default_factory=Counter)  # reason -> count
    dead_values: set[bytes] = field(default_factory=set)
    constant_gids: list[str] = field(default_factory=list)  # the constant user's rewarded generations
    flood_gids: list[str] = field(default_factory=list)  # the flooding user's rewarded generations


def _generation(gid: str, user: str, t: float, rng: random.Random, repetitive: bool) -> GenerationEvent:
    tokens = tuple([7] * 24) if repetitive else tuple(rng.randrange(3, 500) for _ in range(rng.randint(4, 12)))
    text = "".join(chr(97 + t % 26) for t in tokens)
    return GenerationEvent(
        generation_id=gid, group_id=f"grp-{gid}", model_name="tiny", model_version=rng.randint(0, 2),
        user_id=user, endpoint="chat", created_at=t - 0.05, completed_at=t, latency_ms=50.0,
        prompt_text="say something", prompt_token_ids=(1, 2, 3), completion_text=text,
        completion_token_ids=tokens, logprobs=tuple(-0.5 for _ in tokens),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32), finish_reason="stop",
    )


def _feedback(fid: str, gid: str, signal: str, t: float, user: str, text: str | None = None) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=fid, generation_id=gid, signal=signal, edited_text=text,
                         decision_ms=1000.0, user_id=user, created_at=t, received_at=t + 0.01)


def _chunk(ds: Dataset, topics, c: int, per_chunk: int, t: float, rng: random.Random,
           flood: bool = False) -> None:
    out: list[tuple[str, str | None, bytes]] = []
    for i in range(per_chunk):
        gid = f"g{c:03d}-{i:04d}"
        if i % 25 == 0:
            user = CONSTANT_USER
        elif flood and i % 2 == 1:
            user = FLOOD_USER
        else:
            user = f"u{rng.randrange(40)}"
        repetitive = i % 40 == 7
        g = _generation(gid, user, t, rng, repetitive)
        ds.generations.add(gid)
        out.append((topics.generations, gid, encode(g)))
        if rng.random() < 0.03:  # the producer retried: the same generation twice
            out.append((topics.generations, gid, encode(g)))
        roll = rng.random()
        if user == CONSTANT_USER:
            signal = "accept"
        elif user == FLOOD_USER:  # mixed, never missing: every flood generation is rated
            signal = "accept" if roll < 0.5 else "reject"
        else:
            signal = ("accept" if roll < 0.4 else "reject" if roll < 0.6 else "edit" if roll < 0.75
                      else "ignore" if roll < 0.8 else None)
        fbs: list[FeedbackEvent] = []
        if signal is not None:
            text = g.completion_text[: len(g.completion_text) // 2] + "xy" if signal == "edit" else None
            fbs.append(_feedback(f"f-{gid}", gid, signal, t + rng.uniform(0.01, 0.5), user, text))
            if signal in ("accept", "reject") and user not in (CONSTANT_USER, FLOOD_USER) \
                    and rng.random() < 0.08:
                other = "reject" if signal == "accept" else "accept"  # a reviewer's later change of mind
                fbs.append(_feedback(f"f2-{gid}", gid, other, t + 0.9, f"{user}-reviewer"))
        winner = fbs[-1] if fbs else None
        if winner is not None:
            ds.rewards[gid] = (winner.signal, expected_reward(
                winner.signal, g.completion_text, winner.edited_text, 1000.0, repetitive), len(fbs) > 1)
            ds.raters[gid] = winner.user_id
            if user == CONSTANT_USER:
                ds.constant_gids.append(gid)
            if user == FLOOD_USER:
                ds.flood_gids.append(gid)
        for fb in fbs:
            out.append((topics.feedback, gid, encode(fb)))
            if rng.random() < 0.1:  # a duplicate delivery of the same feedback_id
                out.append((topics.feedback, gid, encode(fb)))
        if rng.random() < 0.03:  # feedback the user sent after the window closed
            late = encode(_feedback(f"late-{gid}", gid, "reject", t + WINDOW_S + 1.0, user))
            out.append((topics.feedback, gid, late))
            ds.dead["late_feedback"] += 1
            ds.dead_values.add(late)
    for i in range(per_chunk // 40):  # feedback whose generation never arrives
        orphan = encode(_feedback(f"orphan-{c}-{i}", f"missing-{c}-{i}", "accept", t, "u0"))
        out.append((topics.feedback, f"missing-{c}-{i}", orphan))
        ds.dead["orphan_feedback"] += 1
        ds.dead_values.add(orphan)
    bad = _malformed(topics, c, t)
    if c == 0:  # one record over the 4 MiB limit (only once: it is slow to move around)
        bad.append(("oversized", topics.feedback, "big", b'{"kind": "feedback", "pad": "' + b"a" * (4 << 20) + b'"}'))
    for reason, topic, key, raw in bad:
        out.append((topic, key, raw))
        ds.dead[reason] += 1
        ds.dead_values.add(raw)
    rng.shuffle(out)
    ds.chunks.append(out)


def _malformed(topics, c: int, t: float) -> list[tuple[str, str, str | None, bytes]]:
    good = json.loads(encode(_feedback(f"bad-{c}", f"g{c:03d}-0000", "accept", t, "u0")))
    return [
        ("undecodable", topics.feedback, "x", b"\xff\xfe not json"),
        ("undecodable", topics.generations, None, b"[1, 2, 3]"),
        ("unknown_version", topics.feedback, f"g{c:03d}-0000", json.dumps({**good, "schema_version": 99}).encode()),
        ("invalid", topics.feedback, f"g{c:03d}-0000",
         json.dumps({**good, "signal": "edit", "feedback_id": f"bad2-{c}"}).encode()),
        ("wrong_kind", topics.generations, "k", json.dumps({"kind": "reward"}).encode()),
        ("wrong_key", topics.feedback, "not-the-gid", json.dumps({**good, "feedback_id": f"bad3-{c}"}).encode()),
        # json writes NaN, and once such a time failed the stage's whole batch in SQLite
        ("invalid", topics.feedback, f"g{c:03d}-0000",
         json.dumps({**good, "feedback_id": f"bad4-{c}", "created_at": float("nan")}).encode()),
        # a client clock a day ahead: its window would hold state until then
        ("clock_skew", topics.feedback, f"g{c:03d}-0000",
         json.dumps({**good, "feedback_id": f"bad5-{c}", "created_at": t + 86_400}).encode()),
    ]


def build_dataset(topics, chunks: int, per_chunk: int, t0: float, seed: int = 7,
                  flood: bool = False) -> Dataset:
    """``flood``: every other generation (but the constant user's) is ``FLOOD_USER``'s, each rated
    accept or reject by that user; without it the dataset is the same as it always was."""
    ds, rng = Dataset(), random.Random(seed)
    for c in range(chunks):
        _chunk(ds, topics, c, per_chunk, t0 + c * 1.0, rng, flood)
    return ds


def produce(kafka_settings, ds: Dataset, t0: float, during=None) -> None:
    """Send chunk c at t0 + c seconds (its event times), calling ``during(c)`` between chunks."""
    producer = make_producer(kafka_settings, "test-feed")
    try:
        for c, chunk in enumerate(ds.chunks):
            time.sleep(max(0.0, t0 + c * 1.0 - time.time()))
            for topic, key, value in chunk:
                producer.send(topic, key=key, value=value)
            producer.flush()
            if during:
                during(c)
    finally:
        producer.close()


@pytest.fixture(params=["confluent", "kafka-python"])
def kafka_settings(request, kafka_settings):
    """The fast-join test settings, once with each producer client the stages' outbox supports."""
    return kafka_settings.model_copy(update={"producer_client": request.param})


def stage_env(kafka_settings, topics, data_dir: Path) -> dict[str, str]:
    """The shared stage variables (conftest) plus this test's producer client, window and rules."""
    return base_stage_env(
        kafka_settings, topics, data_dir,
        FLYWHEEL_KAFKA_PRODUCER_CLIENT=kafka_settings.producer_client,
        FLYWHEEL_INGEST_WINDOW_S=str(WINDOW_S),
        FLYWHEEL_INGEST_ORPHAN_WAIT_S=str(WINDOW_S),
        FLYWHEEL_INGEST_GRACE_S=str(GRACE_S),
        FLYWHEEL_REWARD_LATENCY_BONUS=str(BONUS),
        FLYWHEEL_REWARD_LATENCY_REF_MS=str(REF_MS),
        FLYWHEEL_REWARD_REPETITION_PENALTY=str(REPEAT_PENALTY),
        FLYWHEEL_REWARD_CONSTANT_MIN_SIGNALS=str(CONSTANT_MIN),
        FLYWHEEL_REWARD_GUARD_WINDOW_S="1e9",  # one guard window for the whole run
    )


@dataclass
class Outcome:
    """What :func:`check_outcome` read: the rewards topic decoded, and the rewards archive."""

    rewards: list[RewardEvent]
    rewards_archive: pd.DataFrame


def check_outcome(kafka_settings, topics, ds: Dataset, data_dir: Path | list[Path],
                  reward_shards: list[tuple[int, ...]] | None = None) -> Outcome:
    """Topics and archives hold exactly the expected records.

    ``data_dir``: the stages' data directories (several when they run as shard processes, each
    archiving its own shards). ``reward_shards``: the shards of each reward process, whose guards
    count a user over its own shards only; None for one process with all of them.
    """
    data_dirs = data_dir if isinstance(data_dir, list) else [data_dir]
    rewards = read_all(kafka_settings.bootstrap, topics.rewards, expect=len(ds.rewards), timeout_s=60)
    episodes = read_all(kafka_settings.bootstrap, topics.episodes, expect=len(ds.generations), timeout_s=30)
    dead = read_all(kafka_settings.bootstrap, topics.deadletter, expect=sum(ds.dead.values()), timeout_s=30)

    # one episode per generation, one reward per generation with (in-window) feedback
    ep_ids = Counter(decode(EpisodeEvent, r.value).generation_id for r in episodes)
    assert set(ep_ids) == ds.generations and max(ep_ids.values()) == 1
    got = [decode(RewardEvent, r.value) for r in rewards]
    assert all(rec.key == ev.generation_id.encode() for rec, ev in zip(rewards, got))
    assert Counter(r.generation_id for r in got).most_common(1)[0][1] == 1, "a reward was emitted twice"
    assert {r.generation_id for r in got} == set(ds.rewards)
    for r in got:
        signal, value, _ = ds.rewards[r.generation_id]
        assert r.signal == signal, r.generation_id
        assert r.rater_id == ds.raters[r.generation_id], r.generation_id
        assert r.reward == pytest.approx(value, abs=1e-9), (r.generation_id, r.components)
    conflicted = {decode(EpisodeEvent, r.value).generation_id for r in episodes
                  if decode(EpisodeEvent, r.value).conflicted}
    assert conflicted == {g for g, (_, _, c) in ds.rewards.items() if c}
    constant = [r for r in got if r.user_id == CONSTANT_USER]
    flagged = [r for r in constant if "constant_user" in r.flags]
    groups = [ds.constant_gids] if reward_shards is None else [
        [g for g in ds.constant_gids if out_partition(g, "", kafka_settings.partitions) in shards]
        for shards in reward_shards]
    assert len(flagged) == sum(max(0, len(g) - (CONSTANT_MIN - 1)) for g in groups)
    assert all(r.weight < 1.0 for r in flagged)

    # dead letters: exactly the bad records, each with its reason and original bytes
    letters = [decode(DeadLetterEvent, r.value, max_bytes=16 << 20) for r in dead]
    assert Counter(d.reason for d in letters) == ds.dead
    assert {base64.b64decode(d.value_b64) for d in letters} == ds.dead_values
    assert all(d.source_offset is not None and d.source_topic for d in letters)
    # every reason is one its stage declares, so its count was exported at 0 before the first
    declared = {"ingest": INGEST_REASONS, "reward": REWARD_REASONS}
    assert all(d.reason in declared[d.stage] for d in letters)
    # each letter points at the very record it quotes, on an input of the stage that sent it,
    # and no record is dead-lettered twice
    sent = Counter(topic for chunk in ds.chunks for topic, _, _ in chunk)
    inputs = {(topics.episodes, r.partition, r.offset): r for r in episodes}
    for topic in (topics.generations, topics.feedback):
        records = read_all(kafka_settings.bootstrap, topic, expect=sent[topic], timeout_s=30)
        assert len(records) == sent[topic], topic
        inputs.update({(topic, r.partition, r.offset): r for r in records})
    sender = {topics.generations: "ingest", topics.feedback: "ingest", topics.episodes: "reward"}
    sources = Counter((d.source_topic, d.source_partition, d.source_offset) for d in letters)
    assert max(sources.values(), default=1) == 1, "a record was dead-lettered twice"
    for d in letters:
        where = f"{d.source_topic}[{d.source_partition}]@{d.source_offset}"
        src = inputs.get((d.source_topic, d.source_partition, d.source_offset))
        assert src is not None, f"{d.reason} letter points at no input record: {where}"
        assert d.stage == sender[d.source_topic], where
        key, value = src.key, src.value or b""
        if d.truncated:  # quoted in part: the start of each
            key = key[:DEADLETTER_PREFIX_BYTES] if key is not None else None
            value = value[:DEADLETTER_PREFIX_BYTES]
        quoted_key = base64.b64decode(d.key_b64) if d.key_b64 is not None else None
        assert (quoted_key, base64.b64decode(d.value_b64)) == (key, value), where

    # the archives read back the same rows (they follow the topics by up to archive.max_age_s)
    ep_archive = read_archives(data_dirs, "episodes", len(ds.generations))
    assert len(ep_archive) == len(ds.generations) and set(ep_archive["generation_id"]) == ds.generations
    rw_archive = read_archives(data_dirs, "rewards", len(got))
    assert rw_archive["generation_id"].is_unique, "a reward was archived twice"
    assert set(rw_archive["generation_id"]) == {r.generation_id for r in got}
    by_id = {r.generation_id: r for r in got}
    for gid, sig, reward, weight, flags in zip(rw_archive["generation_id"], rw_archive["signal"],
                                               rw_archive["reward"], rw_archive["weight"],
                                               rw_archive["flags"]):
        r = by_id[gid]
        assert (sig, weight, tuple(flags)) == (r.signal, r.weight, tuple(r.flags)), gid
        assert reward == pytest.approx(r.reward), gid
    return Outcome(got, rw_archive)


def check_flood(ds: Dataset, outcome: Outcome, cfg: RewardSettings) -> None:
    """The flooder of ``build_dataset(flood=True)`` keeps exactly what the share cap allows;
    every flood reward beyond it, and no other, is ``user_cap`` with weight 0, in the rewards
    topic and in the archive. ``cfg``: the reward stage's settings (one process, one guard
    window for the whole run)."""
    got = outcome.rewards
    flood = [r for r in got if r.rater_id == FLOOD_USER]
    assert sorted(r.generation_id for r in flood) == sorted(ds.flood_gids)
    others = Counter(r.rater_id for r in got if r.rater_id != FLOOD_USER)
    assert max(others.values()) < cfg.user_cap_min, "another user rates enough to be capped too"
    # reward/guards.py: a rated sample is kept (not capped) iff within_cap(the rater's kept samples
    # before it, the window's kept samples before it). Before a flood sample the window has kept
    # at least the flooder's own kept samples and at most every other reward of the run. The
    # flooder's count after a sample never falls as either count before it grows (kept: +1 while
    # within the cap, capped: +0 once at it), so replaying the rule with the smallest and with the
    # largest window bounds the count the stage reached, in whatever order it judged them.
    lo = hi = 0
    for _ in flood:
        lo += within_cap(lo, lo, cfg)
        hi += within_cap(hi, len(got) - 1, cfg)
    # this configuration leaves the rule one answer (the share never binds), and the cap fires
    assert lo == hi == cfg.user_cap_min < len(flood), (lo, hi, len(flood))
    kept = [r for r in flood if r.weight > 0]
    capped = {r.generation_id for r in flood if r.weight == 0}
    assert len(kept) == lo
    assert len(capped) == len(flood) - lo
    assert {r.generation_id for r in got if "user_cap" in r.flags} == capped
    archived = {g for g, flags in zip(outcome.rewards_archive["generation_id"], outcome.rewards_archive["flags"])
                if "user_cap" in flags}
    assert archived == capped


def read_archives(data_dirs: list[Path], name: str, expect: int, timeout_s: float = 30.0) -> pd.DataFrame:
    """The union of the stages' ``name`` archives once it holds ``expect`` rows (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        roots = [d / "archive" / name for d in data_dirs]
        frames = [pd.read_parquet(r) for r in roots if any(r.glob("hour=*/*.parquet"))]
        table = pd.concat(frames) if frames else pd.DataFrame({"generation_id": []})
        if len(table) >= expect or time.monotonic() > deadline:
            return table
        time.sleep(0.2)


def test_pipeline_in_process_exactly_once(kafka_settings, topics, tmp_path):
    """Both stages in this process (threads); messy input; exact outputs and archives."""
    from flywheel.settings import load_settings
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    settings = load_settings(env=stage_env(kafka_settings, topics, tmp_path))
    t0 = time.time() + 1.0
    ds = build_dataset(topics, chunks=6, per_chunk=250, t0=t0)
    stop = threading.Event()
    threads = [threading.Thread(target=fn, args=(settings, None, stop), daemon=True)
               for fn in (run_ingest, run_reward)]
    for th in threads:
        th.start()
    try:
        produce(kafka_settings, ds, t0)
        check_outcome(kafka_settings, topics, ds, tmp_path)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=30)


# The producer client plays no part in a rebalance: the second one runs in the slow suite.
@pytest.mark.parametrize("kafka_settings", ["confluent", pytest.param("kafka-python", marks=pytest.mark.slow)],
                         indirect=True)
def test_pipeline_survives_a_foreign_member_of_its_consumer_groups(kafka_settings, topics, tmp_path, caplog):
    """Another consumer joins each stage's consumer group mid-stream (an operator's console
    consumer under the stage's group id, say), takes a partition of every input away, reads it and
    commits offsets there, then leaves. The stages lose the shard (settling what is in flight
    first), drop the batch a rebalance interrupted, get the shard back, resume from their stored
    offsets (not the group's) and recover its outbox: still exactly once."""
    from kafka.coordinator.assignors.range import RangePartitionAssignor

    from flywheel.kafka.clients import make_consumer
    from flywheel.settings import load_settings
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    caplog.set_level(logging.INFO, logger="ingest.runner")
    settings = load_settings(env=stage_env(kafka_settings, topics, tmp_path))
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)
    stop, leave = threading.Event(), threading.Event()
    threads = [threading.Thread(target=fn, args=(settings, None, stop), daemon=True)
               for fn in (run_ingest, run_reward)]
    read: Counter = Counter()

    def intruder(group: str, inputs: list[str]) -> None:
        consumer = make_consumer(kafka_settings, "intruder", group, inputs, enable_auto_commit=True,
                                 auto_commit_interval_ms=100,
                                 partition_assignment_strategy=[RangePartitionAssignor])
        try:
            while not leave.is_set():
                read[group] += sum(len(r) for r in consumer.poll(timeout_ms=100).values())
        finally:
            consumer.close()  # commits where it read to: the stage must not resume from there

    intruders = [threading.Thread(target=intruder, args=args, daemon=True) for args in (
        (settings.ingest.group_id, [topics.generations, topics.feedback]),
        (settings.reward.group_id, [topics.episodes]))]

    def chaos(c: int) -> None:
        if c == 1:
            for th in intruders:
                th.start()
        elif c == 5:
            leave.set()
            for th in intruders:
                th.join(timeout=30)

    for th in threads:
        th.start()
    try:
        produce(kafka_settings, ds, t0, during=chaos)
        check_outcome(kafka_settings, topics, ds, tmp_path)
    finally:
        leave.set()
        stop.set()
        for th in threads:
            th.join(timeout=30)
    # each intruder did hold a partition and read records there
    assert read[settings.ingest.group_id] > 0 and read[settings.reward.group_id] > 0, read
    settled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("assigned shards")]
    assert any(m.startswith(("assigned shards [0];", "assigned shards [1];")) for m in settled), settled


class Stages:
    """The stages as subprocesses (``python -m ingest.main`` / ``reward.main``), by name.

    ``add(name, module, env)`` registers a process (e.g. one shard of a stage) with environment
    of its own on top of the common one; a plain stage name is its own module.
    """

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, **env}
        self.log_dir = log_dir
        self.specs: dict[str, tuple[str, dict[str, str]]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.kills = Counter()

    def add(self, name: str, module: str, env: dict[str, str]) -> None:
        self.specs[name] = (module, {**self.env, **env})

    def start(self, name: str) -> None:
        module, env = self.specs.get(name, (name, self.env))
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child keeps its own handle
            self.procs[name] = subprocess.Popen([sys.executable, "-m", f"{module}.main"], env=env,
                                                stdout=log, stderr=subprocess.STDOUT)

    def kill9(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()
        self.kills[name] += 1
        self.start(name)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_with_kills(kafka_settings, topics, tmp_path, chunks: int, per_chunk: int, kill_every: int) -> None:
    env = stage_env(kafka_settings, topics, tmp_path)
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=chunks, per_chunk=per_chunk, t0=t0)
    stages = Stages(env, tmp_path)
    stages.start("ingest")
    stages.start("reward")
    rng = random.Random(3)

    def chaos(c: int) -> None:
        if c % kill_every == kill_every - 1:
            time.sleep(rng.uniform(0.0, 0.8))  # land the kill anywhere in the processing
            stages.kill9("ingest" if (c // kill_every) % 2 == 0 else "reward")

    try:
        produce(kafka_settings, ds, t0, during=chaos)
        time.sleep(1.0)
        stages.kill9("reward")  # once more while it works through the last windows
        check_outcome(kafka_settings, topics, ds, tmp_path)
    finally:
        stages.stop()
    assert stages.kills["ingest"] >= 2 and stages.kills["reward"] >= 2


def test_pipeline_survives_sigkill(kafka_settings, topics, tmp_path):
    """Each stage SIGKILLed and restarted mid-stream, repeatedly: still exactly once."""
    run_with_kills(kafka_settings, topics, tmp_path, chunks=10, per_chunk=200, kill_every=2)


@pytest.mark.slow
def test_pipeline_survives_sigkill_soak(kafka_settings, topics, tmp_path):
    """The same with more data and a kill every chunk."""
    run_with_kills(kafka_settings, topics, tmp_path, chunks=30, per_chunk=300, kill_every=1)


def wait_consumed(kafka_settings, group_id: str, sent: list, timeout_s: float = 30.0) -> None:
    """Wait until ``group_id`` has committed offsets past every record in ``sent`` (their
    ``RecordMetadata``): the stage has processed them."""
    from kafka import KafkaConsumer, TopicPartition

    want: dict[TopicPartition, int] = {}
    for md in sent:
        tp = TopicPartition(md.topic, md.partition)
        want[tp] = max(want.get(tp, 0), md.offset + 1)
    consumer = KafkaConsumer(bootstrap_servers=kafka_settings.bootstrap, group_id=group_id,
                             enable_auto_commit=False)
    deadline = time.monotonic() + timeout_s
    try:
        while any((consumer.committed(tp) or 0) < end for tp, end in want.items()):
            assert time.monotonic() < deadline, f"{group_id} did not consume {want} in {timeout_s}s"
            time.sleep(0.05)
    finally:
        consumer.close(autocommit=False)


def test_pipeline_survives_broker_stall(kafka_settings, topics, tmp_path, broker):
    """The broker stops answering mid-stream for longer than a consumer session: both stages
    lose their group membership and their sends wait. Then, as serving replays what it journaled,
    each chunk's generations arrive after their windows' deadlines and their feedback a second
    later. The stages keep running, every in-time signal still counts, and the outcome is still
    exactly once.

    The stages' producers give up on a send after 3 s here, so the episodes ingest sends early
    in the stall fail before it ends: it replaces its producer, settles the shard and sends
    again (a producer that gave up once delivered nothing more, against this broker)."""
    env = stage_env(kafka_settings, topics, tmp_path)
    env.update(FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS="1000", FLYWHEEL_KAFKA_DELIVERY_TIMEOUT_MS="3000")
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)
    stages = Stages(env, tmp_path)
    stages.start("ingest")
    stages.start("reward")
    producer = make_producer(kafka_settings, "test-feed")
    try:
        for c, chunk in enumerate(ds.chunks):
            time.sleep(max(0.0, t0 + c * 1.0 - time.time()))
            replayed = c > STALL_AFTER_CHUNK
            if c == STALL_AFTER_CHUNK:
                # Ingest has sent an episode, so it knows where episodes go: the stall's windows
                # are sent and fail, rather than wait for partition metadata (a slow start).
                assert read_all(kafka_settings.bootstrap, topics.episodes, expect=1, timeout_s=60), \
                    "ingest delivered no episode before the stall"
            waves = ([[r for r in chunk if r[0] == topics.generations], [r for r in chunk if r[0] != topics.generations]]
                     if replayed else [chunk])
            for wave in waves:
                sent = [producer.send(topic, key=key, value=value) for topic, key, value in wave]
                producer.flush()
                if replayed:
                    time.sleep(REPLAY_GAP_S)
            if c == STALL_AFTER_CHUNK:
                # Stop the broker once ingest has read this chunk: its windows then close (and
                # their episodes are sent) window_s after ingest read them, inside the stall.
                wait_consumed(kafka_settings, f"{topics.prefix}ingest", [f.get() for f in sent])
                broker.pause()
                try:
                    time.sleep(STALL_S)
                finally:
                    broker.resume()
        check_outcome(kafka_settings, topics, ds, tmp_path)
        assert {name: p.poll() for name, p in stages.procs.items()} == {"ingest": None, "reward": None}
        # the stall did outlast a send (ingest closes windows during it): the path above ran
        assert "a send failed; replacing the producer" in (tmp_path / "ingest.log").read_text(errors="replace")
    finally:
        producer.close()
        stages.stop()


def flood_env(kafka_settings, topics, data_dir: Path, ds: Dataset, **extra: str) -> dict[str, str]:
    """:func:`stage_env` with a share cap for ``ds``'s flooder: a minimum of one more than any
    other user rates (so the cap catches the flooder alone), and ``FLOOD_CAP_SHARE``."""
    cap_min = 1 + max(n for user, n in Counter(ds.raters.values()).items() if user != FLOOD_USER)
    return {**stage_env(kafka_settings, topics, data_dir),
            "FLYWHEEL_REWARD_USER_CAP_MIN": str(cap_min),
            "FLYWHEEL_REWARD_USER_CAP_SHARE": str(FLOOD_CAP_SHARE), **extra}


@pytest.mark.parametrize("kafka_settings", ["confluent"], indirect=True)
def test_flooding_user_is_capped(kafka_settings, topics, tmp_path):
    """A user sends half of a window's generations, rated accept and reject: the reward stage keeps
    exactly the share cap's worth of them and flags the rest ``user_cap`` at weight 0, in the
    rewards topic and in the archive; nobody else is capped; everything else is exactly once."""
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=4, per_chunk=150, t0=t0, flood=True)
    env = flood_env(kafka_settings, topics, tmp_path, ds)
    stages = Stages(env, tmp_path)
    stages.start("ingest")
    stages.start("reward")
    try:
        produce(kafka_settings, ds, t0)
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path)
        check_flood(ds, outcome, load_settings(env=env).reward)
    finally:
        stages.stop()


#: The test-only crash points (tests/integration/crashpoints/sitecustomize.py).
CRASHPOINTS = Path(__file__).parent / "crashpoints"
CRASH_ENV, CRASH_MARK = "FLYWHEEL_TEST_CRASH_AT", "crashpoint: SIGKILL at"
#: Crash point -> the crashes in a row before a clean start, each ``point`` (the first time the
#: process gets there) or ``point:N`` (the N-th). ``scan``: the first crash leaves rows to settle,
#: the second start dies in the middle of settling them.
CRASH_PLANS = {"mark_delivered": ("mark_delivered",), "archived": ("archived",),
               "scan": ("mark_delivered", "scan")}
#: The same later in the stream, with more in flight and more state behind (the soak).
LATE_CRASH_PLANS = {"mark_delivered": ("mark_delivered:5",), "archived": ("archived:4",),
                    "scan": ("mark_delivered:5", "scan")}
RECOVERED = re.compile(r"recovery: (\d+) of (\d+) outbox rows were already delivered")
REARCHIVED = re.compile(r"archive queue: (\d+) of (\d+) rows were already in the archive files")


def run_crash_point(kafka_settings, topics, tmp_path, stage: str, plan: tuple[str, ...], chunks: int,
                    per_chunk: int) -> None:
    """Both stages on the flood dataset; ``stage`` SIGKILLs itself at each crash point of ``plan``
    in turn (restarted at once after each), and finally starts clean. The outcome must be exact,
    and the clean start must have found the last crash's leftovers: outbox rows Kafka already
    had, or archive-queue rows the files already held."""
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=chunks, per_chunk=per_chunk, t0=t0, flood=True)
    env = flood_env(kafka_settings, topics, tmp_path, ds, FLYWHEEL_LOG_LEVEL="INFO")  # recovery logs INFO
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CRASHPOINTS), os.environ.get("PYTHONPATH")) if p)
    stages = Stages(env, tmp_path)
    points = [p.partition(":")[0] for p in plan]
    log = tmp_path / f"{stage}.log"
    deaths: list[int] = []
    clean_from: list[int] = []  # where the clean start's part of the log begins

    def start_next() -> None:
        if len(deaths) < len(plan):
            stages.add(stage, stage, {CRASH_ENV: plan[len(deaths)]})
        else:
            stages.add(stage, stage, {})
            clean_from.append(log.stat().st_size)
        stages.start(stage)

    def restart_if_dead(_: int = 0) -> None:
        proc = stages.procs[stage]
        if clean_from or proc.poll() is None:
            return
        assert proc.returncode == -signal.SIGKILL, \
            f"{stage} exited with {proc.returncode}, not at a crash point:\n{log.read_text(errors='replace')[-3000:]}"
        deaths.append(proc.returncode)
        start_next()

    start_next()
    stages.start("reward" if stage == "ingest" else "ingest")
    try:
        produce(kafka_settings, ds, t0, during=restart_if_dead)
        deadline = time.monotonic() + 60
        while not clean_from:
            assert time.monotonic() < deadline, f"{stage} did not reach its crash points {plan}: died {deaths}"
            time.sleep(0.1)
            restart_if_dead()
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path)
        check_flood(ds, outcome, load_settings(env=env).reward)
        # A crash late in the stream leaves the outputs complete (what was acked is in Kafka):
        # the restart may not have settled its leftovers yet. Its log line says it did.
        settled = REARCHIVED if points[-1] == "archived" else RECOVERED
        deadline = time.monotonic() + 30
        while not settled.search(log.read_text(errors="replace")[clean_from[0]:]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {name: p.poll() for name, p in stages.procs.items()} == {"ingest": None, "reward": None}
    finally:
        stages.stop()
    text = log.read_text(errors="replace")
    assert deaths == [-signal.SIGKILL] * len(plan)
    assert [m.group(1) for m in re.finditer(rf"{CRASH_MARK} (\w+)", text)] == points
    found = [int(m.group(1)) for m in settled.finditer(text[clean_from[0]:])]
    assert found and max(found) > 0, f"the restart found nothing the crash left ({settled.pattern}): {found}"


@pytest.mark.parametrize("kafka_settings", ["confluent"], indirect=True)
@pytest.mark.parametrize(("stage", "point"), [("reward", "mark_delivered"), ("ingest", "scan"),
                                              ("ingest", "archived")])
def test_pipeline_recovers_at_crash_point(kafka_settings, topics, tmp_path, stage, point):
    """A stage killed at a moment that needs recovery (acked but unconfirmed sends, archive files
    renamed but still queued, a recovery scan cut short) restarts into the exact outcome, having
    found the leftovers. Each point once here (both stages run the same loop); every stage and
    point with each producer client in the soak."""
    run_crash_point(kafka_settings, topics, tmp_path, stage, CRASH_PLANS[point], chunks=3, per_chunk=150)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(CRASH_PLANS))
@pytest.mark.parametrize("stage", ["ingest", "reward"])
def test_pipeline_recovers_at_crash_point_soak(kafka_settings, topics, tmp_path, stage, point):
    """The same with more data, later in the stream, with each producer client the outbox supports."""
    run_crash_point(kafka_settings, topics, tmp_path, stage, LATE_CRASH_PLANS[point], chunks=10, per_chunk=300)
