"""End to end: generations + feedback -> ingest -> reward on the real broker, effect exactly once.

The dataset is messy on purpose: shuffled order (feedback before its generation), duplicate
feedback and generations, conflicting signals, late feedback, orphans and malformed records. The
expected outcome is computed here from the documented rules (ingest/join.py, reward/labelers.py)
with an independent edit-distance implementation, then compared with the rewards topic, the
dead-letter topic and both Parquet archives.

Delivery is at least once with idempotency keys (docs/exactly-once.md): outbox rows still there
after a crash are sent again, so a topic may hold a record twice, and every reader drops the
repeat by its key. So the checks are: the DISTINCT episodes, rewards (by generation_id) and dead
letters (by the record they quote) are exactly the expected ones with the expected values; every
repeat is the very record again (one outbox row sent twice, not a second output); repeats come
only from stages whose processes died (or whose sends failed after landing), and no more than
what the dead processes left in their outboxes; the reward stage drops each repeated episode
(``reward_duplicates_total``); the archives, written from the state stores, hold each row once.

Some tests run each stage as a subprocess and SIGKILL them mid-stream several times. Random
kills rarely land on the moments that matter, so the crash-point tests make a stage kill itself
exactly there (tests/integration/crashpoints/sitecustomize.py, loaded through the child's
PYTHONPATH; no product code is changed): after a batch's transaction committed its outputs but
before they were sent, after Kafka acked sends but before the outbox deleted them, in a restart
sending those again, and after archive files were renamed but before the queue let go of their
rows. A flooding user (half of all generations) checks the share cap on the real broker: the
flooder keeps exactly what reward/guards.py's ``within_cap`` allows.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from conftest import read_all
from conftest import stage_env as base_stage_env

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
from flywheel.kafka.clients import high_watermarks, make_producer
from flywheel.settings import KafkaSettings, RewardSettings, load_settings
from flywheel.stream.deadletters import DEADLETTER_PREFIX_BYTES
from ingest.stage import DEADLETTER_REASONS as INGEST_REASONS
from reward.guards import within_cap
from reward.stage import DEADLETTER_REASONS as REWARD_REASONS

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

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


def stage_env(kafka_settings, topics, data_dir: Path, **extra: str) -> dict[str, str]:
    """The shared stage variables (conftest) plus this test's producer client, window and rules."""
    return base_stage_env(kafka_settings, topics, data_dir, **{
        "FLYWHEEL_KAFKA_PRODUCER_CLIENT": kafka_settings.producer_client,
        "FLYWHEEL_INGEST_WINDOW_S": str(WINDOW_S),
        "FLYWHEEL_INGEST_ORPHAN_WAIT_S": str(WINDOW_S),
        "FLYWHEEL_INGEST_GRACE_S": str(GRACE_S),
        "FLYWHEEL_REWARD_LATENCY_BONUS": str(BONUS),
        "FLYWHEEL_REWARD_LATENCY_REF_MS": str(REF_MS),
        "FLYWHEEL_REWARD_REPETITION_PENALTY": str(REPEAT_PENALTY),
        "FLYWHEEL_REWARD_CONSTANT_MIN_SIGNALS": str(CONSTANT_MIN),
        "FLYWHEEL_REWARD_GUARD_WINDOW_S": "1e9",  # one guard window for the whole run
        **extra,
    })


# -- the stages' ops endpoints and state stores, as the checks read them ---------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ops_get(port: int, path: str) -> bytes:
    """The body of ``GET path`` on a stage's ops server (/health answers 503 while stalled)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        return exc.read()


def metric(port: int, name: str) -> float:
    """The value of the unlabeled series ``name`` on the stage's /metrics."""
    for line in ops_get(port, "/metrics").decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no series {name} on port {port}")


def wait_delivered(ports: dict[str, int], timeout_s: float = 60.0) -> None:
    """Wait until every stage process (name -> ops port) owes nothing: its outbox is empty, so
    everything it stored, repeats after a crash included, is acked and on its topic."""
    deadline = time.monotonic() + timeout_s
    for name, port in ports.items():
        health: dict | None = None
        while True:
            try:
                health = json.loads(ops_get(port, "/health"))
                if health.get("owed") == 0:  # absent until the loop runs (a start waits for its shards)
                    break
            except OSError:
                pass  # not serving yet (it starts once its shards are granted)
            assert time.monotonic() < deadline, f"{name} still owes outputs after {timeout_s}s: {health}"
            time.sleep(0.2)


def outbox_rows(store: Path) -> int:
    """The rows in a stopped stage's outbox: what its next start sends (again, where they landed).

    Zero for a stage killed before it made its store (it opens its probes first, then waits for
    the broker and its shards): it owes nothing."""
    if not store.exists():
        return 0
    db = sqlite3.connect(f"file:{store}?mode=rw", uri=True, timeout=30.0)
    try:
        return db.execute("SELECT count(*) FROM outbox").fetchone()[0]
    finally:
        db.close()


def stored_offsets(store: Path) -> dict[tuple[str, int], int]:
    """A running stage's input offsets (read beside it: WAL readers do not block its writes)."""
    db = sqlite3.connect(str(store), timeout=30.0)
    try:
        return {(t, p): n for t, p, n in db.execute("SELECT topic, part, next FROM offsets")}
    finally:
        db.close()


# -- reading the topics ----------------------------------------------------------------------------
def read_topic(bootstrap: str, topic: str, until=None, timeout_s: float = 60.0):
    """Every record of ``topic`` from its start up to its end, and on until ``until(records)``
    holds or ``timeout_s`` passed (then what was read; the checks say what is missing).
    Returns the records and the end offset of each partition read to."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest")
    deadline = time.monotonic() + timeout_s
    out: list = []
    try:
        while not (parts := consumer.partitions_for_topic(topic)):
            assert time.monotonic() < deadline, f"no partitions for {topic}"
            time.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while True:
            # a fetch's high watermark: the embedded broker answers offset requests wrongly
            ends = high_watermarks(KafkaSettings(bootstrap=bootstrap), tps, client_id="test-read")
            while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=300).values():
                    out.extend(records)
            if until is None or until(out) or time.monotonic() >= deadline:
                return out, {tp.partition: n for tp, n in ends.items()}
            time.sleep(0.2)
    finally:
        consumer.close()


def letter_key(rec) -> tuple:
    """A dead letter's idempotency key: its stage and the coordinates of the record it quotes."""
    d = decode(DeadLetterEvent, rec.value, max_bytes=16 << 20)
    return d.stage, d.source_topic, d.source_partition, d.source_offset


def distinct(records, key) -> tuple[dict, Counter]:
    """The first record of each key, and the copies of each key. A copy must be the very record
    again (same Kafka key and bytes): one outbox row sent twice, never a second output for the
    same key (which a reprocessed input would make: its times would differ). A keyed copy lands
    in the original's partition (the producer partitions by key); an unkeyed one (the dead letter
    of a record without a key) may land in any: its reader drops it by the coordinates it quotes."""
    first: dict = {}
    copies: Counter = Counter()
    for rec in records:
        k = key(rec)
        copies[k] += 1
        if k not in first:
            first[k] = rec
            continue
        o = first[k]
        assert (rec.key, rec.value) == (o.key, o.value), \
            f"two different records for {k} on {rec.topic}: not a resend of one outbox row"
        assert rec.key is None or rec.partition == o.partition, \
            f"a repeat of {k} on {rec.topic} landed in partition {rec.partition}, the original in {o.partition}"
    return first, copies


@dataclass
class Outcome:
    """What :func:`check_outcome` read: the distinct rewards decoded, the rewards archive, and the
    repeats on the topics."""

    rewards: list[RewardEvent]
    rewards_archive: pd.DataFrame
    #: stage -> copies beyond the first of its outputs on the topics (its episodes or rewards,
    #: and its dead letters): repeats, which only a crash (or a failed send that had landed) makes
    repeats: Counter
    #: copies beyond the first of the episodes on the topic (ingest's repeats but for its dead
    #: letters), and the end of each partition
    episode_repeats: int
    episode_ends: dict[int, int]
    #: generation_id -> the episodes partition it went to (its shard, in both stages)
    partition_of: dict[str, int]


def check_outcome(kafka_settings, topics, ds: Dataset, data_dir: Path | list[Path],
                  reward_shards: list[tuple[int, ...]] | str | None = None, *, settle=None,
                  repeats_from: set[str] | frozenset[str] = frozenset()) -> Outcome:
    """The topics and archives hold exactly the expected records, each output once but for
    repeats of the stages in ``repeats_from``.

    Effect exactly once: the DISTINCT episodes (by generation_id), rewards (by generation_id) and
    dead letters (by the record they quote) are exactly the expected ones with the expected
    values; every repeat of one is the same record again (an outbox row sent twice), and the
    stages not in ``repeats_from`` (none of their processes died or failed a send) have none. The
    archives, written from the state stores, hold each row once.

    ``settle()``: returns once every stage process owes nothing (:func:`wait_delivered`): the
    topics are then read to their ends, so every repeat is counted. ``data_dir``: the stages'
    data directories (several when they run as shard processes, each archiving its own shards).
    ``reward_shards``: the shards of each reward process, whose guards count a user over its own
    shards only; None for one process with all of them; ``"moving"`` for replicas whose shards
    moved between them during the run (a user's guard counts were then split differently over
    time: only an upper bound holds).
    """
    data_dirs = data_dir if isinstance(data_dir, list) else [data_dir]
    bootstrap, n_dead = kafka_settings.bootstrap, sum(ds.dead.values())
    # first until every distinct output arrived; then, once the stages owe nothing, to the ends
    read_topic(bootstrap, topics.episodes, lambda rs: len({r.key for r in rs}) >= len(ds.generations))
    read_topic(bootstrap, topics.rewards, lambda rs: len({r.key for r in rs}) >= len(ds.rewards))
    read_topic(bootstrap, topics.deadletter, lambda rs: len({letter_key(r) for r in rs}) >= n_dead, timeout_s=30)
    if settle is not None:
        settle()
    episodes, episode_ends = read_topic(bootstrap, topics.episodes)
    rewards, _ = read_topic(bootstrap, topics.rewards)
    dead, _ = read_topic(bootstrap, topics.deadletter)

    # one distinct episode per generation, one distinct reward per generation with (in-window) feedback
    ep_first, ep_copies = distinct(episodes, lambda r: decode(EpisodeEvent, r.value).generation_id)
    assert set(ep_first) == ds.generations
    partition_of = {gid: r.partition for gid, r in ep_first.items()}
    rw_first, rw_copies = distinct(rewards, lambda r: decode(RewardEvent, r.value).generation_id)
    got = [decode(RewardEvent, r.value) for r in rw_first.values()]
    assert all(rec.key == ev.generation_id.encode() for rec, ev in zip(rw_first.values(), got))
    assert {r.generation_id for r in got} == set(ds.rewards)
    for r in got:
        signal, value, _ = ds.rewards[r.generation_id]
        assert r.signal == signal, r.generation_id
        assert r.rater_id == ds.raters[r.generation_id], r.generation_id
        assert r.reward == pytest.approx(value, abs=1e-9), (r.generation_id, r.components)
        # a reward's input and output share a partition: the reward stage's shard is its episode's
        assert rw_first[r.generation_id].partition == partition_of[r.generation_id], r.generation_id
    conflicted = {gid for gid, r in ep_first.items() if decode(EpisodeEvent, r.value).conflicted}
    assert conflicted == {g for g, (_, _, c) in ds.rewards.items() if c}
    constant = [r for r in got if r.user_id == CONSTANT_USER]
    flagged = [r for r in constant if "constant_user" in r.flags]
    if reward_shards == "moving":  # shards moved between processes mid-run: no one count is exact
        assert len(flagged) <= max(0, len(ds.constant_gids) - (CONSTANT_MIN - 1))
    else:
        groups = [ds.constant_gids] if reward_shards is None else [
            [g for g in ds.constant_gids if partition_of[g] in shards] for shards in reward_shards]
        assert len(flagged) == sum(max(0, len(g) - (CONSTANT_MIN - 1)) for g in groups)
    assert all(r.weight < 1.0 for r in flagged)

    # dead letters: exactly the bad records, each with its reason and original bytes, each
    # distinct record once (a repeat is the same letter again)
    dl_first, dl_copies = distinct(dead, letter_key)
    letters = [decode(DeadLetterEvent, r.value, max_bytes=16 << 20) for r in dl_first.values()]
    assert Counter(d.reason for d in letters) == ds.dead
    assert {base64.b64decode(d.value_b64) for d in letters} == ds.dead_values
    assert all(d.source_offset is not None and d.source_topic for d in letters)
    # every reason is one its stage declares, so its count was exported at 0 before the first
    declared = {"ingest": INGEST_REASONS, "reward": REWARD_REASONS}
    assert all(d.reason in declared[d.stage] for d in letters)
    # each letter points at the very record it quotes, on an input of the stage that sent it
    sent = Counter(topic for chunk in ds.chunks for topic, _, _ in chunk)
    inputs = {(topics.episodes, r.partition, r.offset): r for r in episodes}
    for topic in (topics.generations, topics.feedback):
        records, _ = read_topic(bootstrap, topic)
        assert len(records) == sent[topic], topic
        inputs.update({(topic, r.partition, r.offset): r for r in records})
    sender = {topics.generations: "ingest", topics.feedback: "ingest", topics.episodes: "reward"}
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

    # repeats: only where a process of the stage died (or a send failed after landing)
    repeats = Counter({"ingest": sum(n - 1 for n in ep_copies.values()), "reward": sum(n - 1 for n in rw_copies.values())})
    for k, n in dl_copies.items():
        repeats[k[0]] += n - 1
    log.info("repeats on the topics, by stage: %s (episodes %d)", dict(repeats), sum(n - 1 for n in ep_copies.values()))
    for stage in ("ingest", "reward"):
        if stage not in repeats_from:
            assert repeats[stage] == 0, f"{stage} repeated {repeats[stage]} outputs without a crash"

    # the archives read back the same rows, each once (they follow the topics by up to
    # archive.max_age_s): written from the state stores, a resend on a topic is no second row
    ep_archive = read_archives(data_dirs, "episodes", len(ds.generations))
    assert ep_archive["generation_id"].is_unique, "an episode was archived twice"
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
    return Outcome(got, rw_archive, repeats, sum(n - 1 for n in ep_copies.values()), episode_ends, partition_of)


def check_reward_dropped(port: int, store: Path, topics, outcome: Outcome, timeout_s: float = 60.0) -> None:
    """The reward process on ``port`` (running since before the first episode, never restarted)
    read every episode record, repeats included, and dropped each repeat by its generation_id:
    ``reward_duplicates_total`` counts exactly the episode repeats on the topic (its rewards
    hold none, :func:`check_outcome`). ``store``: its state store, whose offsets say how far it
    has read."""
    deadline = time.monotonic() + timeout_s
    while True:
        offsets = stored_offsets(store)
        behind = {p: (offsets.get((topics.episodes, p), 0), end) for p, end in outcome.episode_ends.items()
                  if offsets.get((topics.episodes, p), 0) < end}
        if not behind:
            break
        assert time.monotonic() < deadline, f"reward did not read the episodes to their end: {behind}"
        time.sleep(0.2)
    assert metric(port, "reward_duplicates_total") == outcome.episode_repeats, outcome.repeats


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


def in_process_settings(kafka_settings, topics, data_dir: Path):
    """Settings for both stages run in this process, each with its ops server on a port of its own
    (the checks read their /health and /metrics); and those ports, by stage."""
    from flywheel.settings import load_settings

    ports = {"ingest": free_port(), "reward": free_port()}
    settings = load_settings(env=stage_env(kafka_settings, topics, data_dir,
                                           FLYWHEEL_INGEST_PORT=str(ports["ingest"]),
                                           FLYWHEEL_REWARD_PORT=str(ports["reward"])))
    return settings, ports


# slow (10 s): the foreign-member test below runs the same two stages in this process on the same
# messy input and holds the same exact outcome with not one repeat, and stays in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("kafka_settings", ["confluent", "kafka-python"], indirect=True)
def test_pipeline_in_process_exactly_once(kafka_settings, topics, tmp_path):
    """Both stages in this process (threads); messy input; exact outputs and archives, and with
    nothing crashed not one repeat on a topic."""
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    settings, ports = in_process_settings(kafka_settings, topics, tmp_path)
    t0 = time.time() + 1.0
    ds = build_dataset(topics, chunks=6, per_chunk=250, t0=t0)
    stop = threading.Event()
    threads = [threading.Thread(target=fn, args=(settings, None, stop), daemon=True)
               for fn in (run_ingest, run_reward)]
    for th in threads:
        th.start()
    try:
        produce(kafka_settings, ds, t0)
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=lambda: wait_delivered(ports))
        check_reward_dropped(ports["reward"], tmp_path / "reward" / "state.sqlite3", topics, outcome)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=30)


# A fault run (a foreign member joins the stages' groups; 15 s): slow, with either producer client.
@pytest.mark.slow
@pytest.mark.parametrize("kafka_settings", ["confluent", "kafka-python"], indirect=True)
def test_pipeline_survives_a_foreign_member_of_its_consumer_groups(kafka_settings, topics, tmp_path, caplog):
    """Another consumer joins each stage's consumer group mid-stream (an operator's console
    consumer under the stage's group id, say), takes a partition of every input away, reads it and
    commits offsets there, then leaves. The stages lose the shard (settling what is in flight
    first), drop the batch a rebalance interrupted, get the shard back, resume from their stored
    offsets (not the group's) and send what their outbox still owes: the same outcome, and not
    one repeat (nothing crashed; a shard moves only once its sends are acked).

    The intruders are made to read records, whatever the machine's pace: the chunks after the
    first are produced only once both hold a partition, and each leaves only once it has read
    some. The ingest intruder leaves first: while it holds a partition of ingest's inputs, no
    episode goes to the same partition of the episodes topic, which the reward intruder may hold."""
    from kafka.coordinator.assignors.range import RangePartitionAssignor

    from flywheel.kafka.clients import make_consumer
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    caplog.set_level(logging.INFO, logger="flywheel.stream.runner")
    settings, ports = in_process_settings(kafka_settings, topics, tmp_path)
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=8, per_chunk=200, t0=t0)
    stop = threading.Event()
    threads = [threading.Thread(target=fn, args=(settings, None, stop), daemon=True)
               for fn in (run_ingest, run_reward)]
    groups = {settings.ingest.group_id: [topics.generations, topics.feedback],
              settings.reward.group_id: [topics.episodes]}
    read: Counter = Counter()
    assigned = {group: threading.Event() for group in groups}
    leave = {group: threading.Event() for group in groups}

    def intruder(group: str, inputs: list[str]) -> None:
        consumer = make_consumer(kafka_settings, "intruder", group, inputs, enable_auto_commit=True,
                                 auto_commit_interval_ms=100,
                                 partition_assignment_strategy=[RangePartitionAssignor])
        try:
            while not leave[group].is_set():
                read[group] += sum(len(r) for r in consumer.poll(timeout_ms=100).values())
                if consumer.assignment():
                    assigned[group].set()
        finally:
            consumer.close()  # commits where it read to: the stage must not resume from there

    intruders = {group: threading.Thread(target=intruder, args=(group, inputs), daemon=True)
                 for group, inputs in groups.items()}

    def let_go(group: str, wait_s: float = 0.0) -> None:
        """The intruder in ``group`` leaves once it has read records (waiting up to ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while not read[group] and time.monotonic() < deadline:
            time.sleep(0.1)
        if read[group] and not leave[group].is_set():
            leave[group].set()
            intruders[group].join(timeout=30)

    def owns_every_shard(port: int) -> bool:
        try:
            return json.loads(ops_get(port, "/health")).get("shards") == [0, 1]
        except OSError:
            return False  # not serving yet

    def chaos(c: int) -> None:
        if c == 1:
            # only once each stage held every shard, so its store has noted where it starts
            # them: a partition a stage never held starts where the group committed (a store made
            # afresh goes on from there), and an intruder in first would have committed past
            # records the stage then never reads (a loaded run's reward first got one shard)
            deadline = time.monotonic() + 60
            while not all(owns_every_shard(port) for port in ports.values()):
                assert time.monotonic() < deadline, "the stages did not each hold both shards in 60 s"
                time.sleep(0.1)
            for th in intruders.values():
                th.start()
            for group, event in assigned.items():
                assert event.wait(60), f"the intruder in {group} got no partition in 60 s"
        elif c >= 5:
            for group in groups:  # the ingest intruder first
                let_go(group)

    for th in threads:
        th.start()
    try:
        produce(kafka_settings, ds, t0, during=chaos)
        for group in groups:
            let_go(group, wait_s=60)
        # each intruder did hold a partition and read records there
        assert all(read[g] > 0 for g in groups) and all(e.is_set() for e in leave.values()), read
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=lambda: wait_delivered(ports))
        check_reward_dropped(ports["reward"], tmp_path / "reward" / "state.sqlite3", topics, outcome)
    finally:
        for event in leave.values():
            event.set()
        stop.set()
        for th in threads:
            th.join(timeout=30)
    settled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("assigned shards")]
    assert any(m.startswith(("assigned shards [0];", "assigned shards [1];")) for m in settled), settled


class Stages:
    """The stages as subprocesses (``python -m ingest.main`` / ``reward.main``), by name.

    ``add(name, module, env)`` registers a process (e.g. one shard of a stage) with environment
    of its own on top of the common one; a plain stage name is its own module. Each start gets
    an ops port of its own (``ports``), and each death is noted with the rows its outbox held
    (``leftovers``): what the restart sends again, the most repeats that death can make.
    """

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, **env}
        self.log_dir = log_dir
        self.specs: dict[str, tuple[str, dict[str, str]]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.kills = Counter()
        self.leftovers: dict[str, list[int]] = {}

    def add(self, name: str, module: str, env: dict[str, str]) -> None:
        self.specs[name] = (module, {**self.env, **env})

    def module(self, name: str) -> str:
        return self.specs.get(name, (name, self.env))[0]

    def store(self, name: str) -> Path:
        module, env = self.specs.get(name, (name, self.env))
        return Path(env["FLYWHEEL_DATA_DIR"]) / module / "state.sqlite3"

    def start(self, name: str) -> None:
        module, env = self.specs.get(name, (name, self.env))
        self.ports[name] = free_port()
        env = {**env, f"FLYWHEEL_{module.upper()}_PORT": str(self.ports[name])}
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child keeps its own handle
            self.procs[name] = subprocess.Popen([sys.executable, "-m", f"{module}.main"], env=env,
                                                stdout=log, stderr=subprocess.STDOUT)

    def died(self, name: str) -> None:
        """Note a dead process's leftovers (its store is closed: SIGKILL leaves a consistent WAL)."""
        self.leftovers.setdefault(name, []).append(outbox_rows(self.store(name)))

    def kill9(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()
        self.kills[name] += 1
        self.died(name)
        self.start(name)

    def may_repeat(self, stage: str) -> int:
        """The most repeats the deaths of ``stage``'s processes can have made: each restart sends
        again the rows its predecessor's outbox held, once."""
        return sum(sum(rows) for name, rows in self.leftovers.items() if self.module(name) == stage)

    def wait_delivered(self, timeout_s: float = 60.0) -> None:
        """Every process is alive and owes nothing (:func:`wait_delivered`)."""
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"stage processes died: {dead}"
        wait_delivered(self.ports, timeout_s)

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
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered,
                                repeats_from={"ingest", "reward"})
    finally:
        stages.stop()
    assert stages.kills["ingest"] >= 2 and stages.kills["reward"] >= 2
    # the repeats are at most what the killed processes left in their outboxes
    log.info("kills %s left %s in their outboxes", dict(stages.kills), stages.leftovers)
    for stage in ("ingest", "reward"):
        assert outcome.repeats[stage] <= stages.may_repeat(stage), (stage, outcome.repeats, stages.leftovers)


# A fault run (about 18 s on 2 cores): in the slow suite with both producer clients, so the default
# suite stays under 14 minutes; the default suite keeps the crash between commit and send
# (test_ingest_recovery.py) and the whole pipeline in process with intruders in its groups
# (test_pipeline_survives_a_foreign_member_of_its_consumer_groups), and each client's send and
# report paths have unit tests of their own (tests/unit/test_kafka_producers.py)
@pytest.mark.slow
@pytest.mark.parametrize("kafka_settings", ["confluent", "kafka-python"], indirect=True)
def test_pipeline_survives_sigkill(kafka_settings, topics, tmp_path):
    """Each stage SIGKILLed and restarted mid-stream, repeatedly: the distinct outputs are exact,
    repeats are resends of what the killed processes left, and the archives hold each row once."""
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


# a fault run, slow (27 s, an 8 s stall of the whole pipeline); the default suite keeps each stage's
# stall tests (test_ingest_recovery, test_stage_start, test_kafka_sink, test_producer_gives_up)
@pytest.mark.slow
@pytest.mark.parametrize("kafka_settings", ["confluent", "kafka-python"], indirect=True)
def test_pipeline_survives_broker_stall(kafka_settings, topics, tmp_path, broker):
    """The broker stops answering mid-stream for longer than a consumer session: both stages
    lose their group membership and their sends wait. Then, as serving replays what it journaled,
    each chunk's generations arrive after their windows' deadlines and their feedback a second
    later. The stages keep running, every in-time signal still counts, and the distinct outcome
    is exact; repeats (sends that failed after landing, sent again) are dropped by reward.

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
        # failed sends are sent again: those that had landed anyway are repeats
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered,
                                repeats_from={"ingest", "reward"})
        check_reward_dropped(stages.ports["reward"], stages.store("reward"), topics, outcome)
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


@pytest.mark.slow  # 10 s whole stages; the cap's rule is table-tested (tests/unit/test_reward_rules.py)  # the default suite must stay under 14 minutes on 2 cores
@pytest.mark.parametrize("kafka_settings", ["confluent"], indirect=True)
def test_flooding_user_is_capped(kafka_settings, topics, tmp_path):
    """A user sends half of a window's generations, rated accept and reject: the reward stage keeps
    exactly the share cap's worth of them and flags the rest ``user_cap`` at weight 0, in the
    rewards topic and in the archive; nobody else is capped; everything else is exact, without
    a repeat."""
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=4, per_chunk=150, t0=t0, flood=True)
    env = flood_env(kafka_settings, topics, tmp_path, ds)
    stages = Stages(env, tmp_path)
    stages.start("ingest")
    stages.start("reward")
    try:
        produce(kafka_settings, ds, t0)
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered)
        check_flood(ds, outcome, load_settings(env=env).reward)
        check_reward_dropped(stages.ports["reward"], stages.store("reward"), topics, outcome)
    finally:
        stages.stop()


#: The test-only crash points (tests/integration/crashpoints/sitecustomize.py).
CRASHPOINTS = Path(__file__).parent / "crashpoints"
CRASH_ENV, CRASH_MARK = "FLYWHEEL_TEST_CRASH_AT", "crashpoint: SIGKILL at"
#: Crash point -> the crashes in a row before a clean start, each ``point`` (the first time the
#: process gets there) or ``point:N`` (the N-th). ``resent``: the first crash leaves acked rows
#: in the outbox, the second start dies after the broker acked some of them again.
CRASH_PLANS = {"committed": ("committed",), "delivered": ("delivered",), "resent": ("delivered", "resent"),
               "archived": ("archived",)}
#: The same later in the stream, with more in flight and more state behind (the soak).
LATE_CRASH_PLANS = {"committed": ("committed:5",), "delivered": ("delivered:5",), "resent": ("delivered:5", "resent"),
                    "archived": ("archived:4",)}
#: The crash point's line: how many of the outbox's rows may have been on their topics already.
CRASHED = re.compile(rf"{CRASH_MARK} (\w+) \(pid \d+; landed (\d+)\.\.(\d+)\)")
REARCHIVED = re.compile(r"archive queue: (\d+) of (\d+) rows were already in the archive files")


def run_crash_point(kafka_settings, topics, tmp_path, stage: str, plan: tuple[str, ...], chunks: int,
                    per_chunk: int) -> None:
    """Both stages on the flood dataset; ``stage`` SIGKILLs itself at each crash point of ``plan``
    in turn (restarted at once after each), and finally starts clean. The distinct outcome must
    be exact; the crashed stage's repeats lie between the rows its crashes saw acked and the rows
    they left in the outbox (none where nothing was sent), the other stage's are none, and a
    reward process that ran throughout dropped each repeated episode. After an ``archived``
    crash the clean start must have found the rows the files already held."""
    t0 = time.time() + 3.0
    ds = build_dataset(topics, chunks=chunks, per_chunk=per_chunk, t0=t0, flood=True)
    env = flood_env(kafka_settings, topics, tmp_path, ds, FLYWHEEL_LOG_LEVEL="INFO")  # the archive's finding logs INFO
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CRASHPOINTS), os.environ.get("PYTHONPATH")) if p)
    stages = Stages(env, tmp_path)
    points = [p.partition(":")[0] for p in plan]
    other = "reward" if stage == "ingest" else "ingest"
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
        stages.died(stage)
        start_next()

    start_next()
    stages.start(other)
    try:
        produce(kafka_settings, ds, t0, during=restart_if_dead)
        deadline = time.monotonic() + 60
        while not clean_from:
            assert time.monotonic() < deadline, f"{stage} did not reach its crash points {plan}: died {deaths}"
            time.sleep(0.1)
            restart_if_dead()
        outcome = check_outcome(kafka_settings, topics, ds, tmp_path, settle=stages.wait_delivered,
                                repeats_from={stage})
        check_flood(ds, outcome, load_settings(env=env).reward)
        if stage == "ingest":
            check_reward_dropped(stages.ports["reward"], stages.store("reward"), topics, outcome)
        if points[-1] == "archived":
            # the clean start's first archive write asks the files first; its log line says so
            deadline = time.monotonic() + 30
            while not REARCHIVED.search(log.read_text(errors="replace")[clean_from[0]:]) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
        assert {name: p.poll() for name, p in stages.procs.items()} == {"ingest": None, "reward": None}
    finally:
        stages.stop()
    text = log.read_text(errors="replace")
    assert deaths == [-signal.SIGKILL] * len(plan)
    crashes = [(m.group(1), int(m.group(2)), int(m.group(3))) for m in CRASHED.finditer(text)]
    assert [c[0] for c in crashes] == points, crashes
    left = stages.leftovers[stage]
    for (point, _, most), rows in zip(crashes, left):
        if point == "committed":  # stored and never sent: only the restart could deliver them
            assert most == 0 and rows > 0, (crashes, left)
        else:  # what the crash saw in the outbox is what the store held after it: committed rows survive
            assert most == rows, (crashes, left)
    least, most = sum(c[1] for c in crashes), sum(c[2] for c in crashes)
    assert least <= outcome.repeats[stage] <= most, (outcome.repeats, crashes)
    if any(p in ("delivered", "resent") for p in points):  # acked rows were sent again
        assert outcome.repeats[stage] > 0, (outcome.repeats, crashes)
    if points[-1] == "archived":
        found = [int(m.group(1)) for m in REARCHIVED.finditer(text[clean_from[0]:])]
        assert found and max(found) > 0, f"the restart found nothing the crash left ({REARCHIVED.pattern}): {found}"


@pytest.mark.parametrize("kafka_settings", ["confluent"], indirect=True)
@pytest.mark.parametrize(("stage", "point"), [
    # 12-16 s each, all of them: the crash between commit and send keeps a short test of its own
    # in the default suite (test_ingest_recovery.py)
    pytest.param("ingest", "resent", marks=pytest.mark.slow),
    pytest.param("reward", "delivered", marks=pytest.mark.slow),
    pytest.param("ingest", "committed", marks=pytest.mark.slow),
    pytest.param("ingest", "archived", marks=pytest.mark.slow)])
def test_pipeline_recovers_at_crash_point(kafka_settings, topics, tmp_path, stage, point):
    """A stage killed at a moment of the delivery protocol (outputs committed and not sent; sends
    acked and not yet deleted from the outbox; a restart killed while sending those again;
    archive files renamed but still queued) restarts into the exact distinct outcome, with
    repeats only within what the crash left, dropped downstream. Each point once here (both
    stages run the same loop); every stage and point with each producer client in the soak."""
    run_crash_point(kafka_settings, topics, tmp_path, stage, CRASH_PLANS[point], chunks=3, per_chunk=150)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(CRASH_PLANS))
@pytest.mark.parametrize("stage", ["ingest", "reward"])
def test_pipeline_recovers_at_crash_point_soak(kafka_settings, topics, tmp_path, stage, point):
    """The same with more data, later in the stream, with each producer client the outbox supports."""
    run_crash_point(kafka_settings, topics, tmp_path, stage, LATE_CRASH_PLANS[point], chunks=10, per_chunk=300)
