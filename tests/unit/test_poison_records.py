"""No record, however mangled, fails a stage's batch: it becomes a dead letter or a normal output.

A record that passes the edge and then breaks a later step (the state store, the output encode,
the Parquet archive) fails its whole batch, and after every restart the same batch again: the
stage is down until someone deletes the record by hand. Each case below has been such a record,
or is one step from it. A seeded mutator then derives a few thousand more from valid records,
and every one is driven through the ingest stage, its archive, the reward stage and its archive,
over real SQLite stores and real Parquet files.
"""

from __future__ import annotations

import base64
import json
import random
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry

from flywheel.contracts import (
    MAX_EPISODE_BYTES,
    MAX_FEEDBACK_BYTES,
    MAX_RECORD_BYTES,
    ContractError,
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    RewardEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings, RewardSettings
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.store import StateStore
from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table
from ingest.join import is_from_future, resolve
from ingest.stage import SCHEMA as INGEST_SCHEMA
from ingest.stage import IngestStage, episode_bytes
from reward.report import REWARD_SCHEMA, reward_row, reward_table
from reward.stage import SCHEMA as REWARD_SCHEMA_SQL
from reward.stage import RewardStage

T = Topics("p.")
NOW = 1_700_000_000.0
#: JSON texts a field may be replaced with: wrong types, edges of every range, text no encoder takes
ODD_VALUES = [
    b"null", b'""', b"0", b"-1", b"1.5", b"true", b"[]", b"{}", b'[1, "a"]', b"[[1]]",
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e308", b"2147483648", b"9223372036854775808",
    b"18446744073709551616", b"-9223372036854775809", b'"\\ud800"', b'"a\\udfffb"', b'"\\ud83d\\ude00"',
    b'"\\u0000"', b'"' + b"x" * 300 + b'"', b'"\xe2\x80\xa8"', b"1e-320", b'"1"', b'{"a": [1, {"b": null}]}',
    b"[" * 3000 + b"]" * 3000,  # deeper than Python's recursion limit
    b"1" * 5000,  # past Python's integer digit limit: json.loads raises a plain ValueError
    b'"\xed\xa0\x80"',  # a surrogate written as raw bytes, no escape: not UTF-8
]


def _record(topic: str, key: bytes | None, value: bytes, offset: int) -> ConsumerRecord:
    return ConsumerRecord(topic=topic, partition=0, leader_epoch=-1, offset=offset, timestamp=0, timestamp_type=0,
                          key=key, value=value, headers=[], checksum=None, serialized_key_size=0,
                          serialized_value_size=len(value), serialized_header_size=0)


def _generation(gid: str) -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=3, user_id="u", endpoint="chat",
        created_at=NOW - 30, completed_at=NOW - 29, latency_ms=1000, prompt_text="p", prompt_token_ids=(1, 2),
        completion_text="the answer", completion_token_ids=(5, 6, 7), logprobs=(-0.5, -1.0, -0.1),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=8), finish_reason="stop")


def _feedback(fid: str, gid: str) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=fid, generation_id=gid, signal="edit", edited_text="the answers",
                         decision_ms=800, created_at=NOW - 20, received_at=NOW - 19)


def _fields(obj: dict, prefix: str = "") -> list[str]:
    """Every field path of ``obj``, nested objects and list items included (``a.b``, ``a.0``)."""
    paths = []
    for k, v in obj.items():
        path = f"{prefix}{k}"
        paths.append(path)
        if isinstance(v, dict):
            paths += _fields(v, f"{path}.")
        elif isinstance(v, list) and v:
            paths.append(f"{path}.0")
    return paths


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    """One mangled variant of a valid record: an odd value in a field, a field gone or added,
    or broken bytes."""
    kind = rng.random()
    if kind < 0.03:
        return rng.choice(ODD_VALUES)  # not an object at all
    if kind < 0.1:
        cut = rng.randrange(1, len(raw))
        return raw[:cut] if rng.random() < 0.5 else raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
    obj = json.loads(raw)
    path = rng.choice(_fields(obj)).split(".")
    parent = obj
    for part in path[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = int(path[-1]) if isinstance(parent, list) else path[-1]
    if kind < 0.2 and isinstance(parent, dict):
        del parent[last]
        return json.dumps(obj).encode()
    if kind < 0.25 and isinstance(parent, dict):
        parent["unexpected"] = 1
        return json.dumps(obj).encode()
    marker = "\x00MARK\x00"
    parent[last] = marker
    return json.dumps(obj).encode().replace(json.dumps(marker).encode(), rng.choice(ODD_VALUES))


class Pipeline:
    """Both stages over stores and archives in ``root``, fed by hand, delivering to lists."""

    def __init__(self, root: Path) -> None:
        self.ingest_store = StateStore(root / "ingest.sqlite3", INGEST_SCHEMA)
        self.reward_store = StateStore(root / "reward.sqlite3", REWARD_SCHEMA_SQL)
        self.ingest = IngestStage(IngestSettings(window_s=60, orphan_wait_s=60, grace_s=0), T, self.ingest_store,
                                  CollectorRegistry())
        self.reward = RewardStage(RewardSettings(), T, self.reward_store, CollectorRegistry())
        self.episodes = ParquetArchive(root / "episodes", EPISODE_SCHEMA, episode_row, episode_table)
        self.rewards = ParquetArchive(root / "rewards", REWARD_SCHEMA, reward_row, reward_table)
        self.dead: list[DeadLetterEvent] = []
        self.reward_values: list[bytes] = []

    def run(self, generations: list[bytes], feedback: list[bytes],
            extra_episodes: list[tuple[bytes, bytes]] = ()) -> None:
        records = [_record(T.generations, b"g%d" % i, v, i) for i, v in enumerate(generations)]
        records += [_record(T.feedback, b"g%d" % i, v, i) for i, v in enumerate(feedback)]
        with self.ingest_store.txn():
            self.ingest.process(records, NOW)
        with self.ingest_store.txn():
            self.ingest.tick({0}, NOW + 120)  # every window is closed by then
        episodes = self._drain(self.ingest_store, self.episodes, T.episodes)
        self.episode_values = [v for _, v in episodes]
        eps = [_record(T.episodes, k, v, i) for i, (k, v) in enumerate([*episodes, *extra_episodes])]
        with self.reward_store.txn():
            self.reward.process(eps, NOW + 121)
        self.reward_values = [v for _, v in self._drain(self.reward_store, self.rewards, T.rewards)]

    def _drain(self, store: StateStore, archive: ParquetArchive, topic: str) -> list[tuple[bytes, bytes]]:
        """What the outbox would deliver: archive rows written, outputs returned, dead letters kept."""
        rows = store.pending([0], limit=10**9)
        archive.write(store.epoch, [r for _, rows in store.queued_batches(10**9) for r in rows])
        self.dead += [decode(DeadLetterEvent, r.value) for r in rows if r.topic == T.deadletter]
        return [(r.key.encode(), r.value) for r in rows if r.topic == topic]


@pytest.mark.parametrize("target, old, new", [
    ("generation", b'"completed_at":1699999971.0', b'"completed_at":NaN'),
    ("generation", b'"completed_at":1699999971.0', b'"completed_at":1e400'),
    ("generation", b'"completion_text":"the answer"', b'"completion_text":"\\ud800"'),
    ("generation", b'"completion_token_ids":[5,6,7]', b'"completion_token_ids":[5,6,2147483648]'),
    ("generation", b'"model_version":3', b'"model_version":9223372036854775808'),
    ("generation", b'"logprobs":[-0.5,-1.0,-0.1]', b'"logprobs":[-0.5,NaN,-0.1]'),
    ("generation", b'"latency_ms":1000.0', b'"latency_ms":Infinity'),
    ("feedback", b'"created_at":1699999980.0', b'"created_at":NaN'),
    ("feedback", b'"edited_text":"the answers"', b'"edited_text":"\\udc00"'),
    ("feedback", b'"decision_ms":800.0', b'"decision_ms":1e400'),
])
def test_each_known_poison_record_is_dead_lettered_and_the_rest_flows(tmp_path, target, old, new):
    generations = [encode(_generation(f"g{i}")) for i in range(3)]
    feedback = [encode(_feedback(f"f{i}", f"g{i}")) for i in range(3)]
    batch = generations if target == "generation" else feedback
    assert old in batch[1], batch[1]
    batch[1] = batch[1].replace(old, new)
    p = Pipeline(tmp_path)
    p.run(generations, feedback)
    reasons = Counter((d.stage, d.reason) for d in p.dead)
    if target == "generation":  # its feedback then waits for it, and becomes an orphan
        assert reasons == {("ingest", "invalid"): 1, ("ingest", "orphan_feedback"): 1}
        assert len(p.reward_values) == 2
    else:
        assert reasons == {("ingest", "invalid"): 1}
        assert len(p.reward_values) == 2  # g1 is closed with no signal: not labeled by default


@pytest.mark.parametrize("target, mangle", [
    ("feedback", lambda raw: b"\xef\xbb\xbf" + raw),  # a byte-order mark
    ("feedback", lambda raw: raw.decode().encode("utf-16")),
    ("feedback", lambda raw: raw.decode().encode("utf-32")),
    ("feedback", lambda raw: raw.replace(b'"the answers"', b'"the \xed\xa0\x80answers"')),
    ("feedback", lambda raw: raw.replace(b'"decision_ms":800.0', b'"decision_ms":' + b"9" * 5000)),
    ("generation", lambda raw: raw.replace(b'"the answer"', b'"the \xed\xa0\x80answer"')),
    ("generation", lambda raw: raw.replace(b'"model_version":3', b'"model_version":' + b"1" * 5000)),
    ("generation", lambda raw: raw.decode().encode("utf-16")),
])
def test_records_that_are_not_utf8_json_are_undecodable(tmp_path, target, mangle):
    """Each of these passed the edge (json.loads of bytes guesses UTF-16/32, skips a byte-order
    mark and lets raw surrogate bytes through) and then failed the stage: at the window's close,
    at the re-encode, or (digits) at the edge itself with an error the decoder did not expect."""
    generations = [encode(_generation(f"g{i}")) for i in range(3)]
    feedback = [encode(_feedback(f"f{i}", f"g{i}")) for i in range(3)]
    batch = generations if target == "generation" else feedback
    batch[1] = mangle(batch[1])
    valid = episode_bytes(encode(_generation("e0")), resolve([_feedback("x0", "e0")]), NOW)
    for_reward = [(b"e0", mangle(valid))]
    p = Pipeline(tmp_path)
    p.run(generations, feedback, for_reward)
    reasons = Counter((d.stage, d.reason) for d in p.dead)
    expect = {("ingest", "undecodable"): 1, ("reward", "undecodable"): 1}
    if target == "generation":  # its feedback then waits for it, and becomes an orphan
        expect[("ingest", "orphan_feedback")] = 1
    assert reasons == expect
    assert len(p.reward_values) == 2


def test_valid_records_of_several_mib_reach_both_archives(tmp_path):
    """Arrow's JSON reader refused a record spanning more than two of its 1 MiB blocks, and the
    archive write failed the loop after every restart: the block now outgrows the largest row.
    The episode joins a 3.5 MB generation with a 0.9 MB edit: larger than any one input record
    may be, and still taken by the reward stage (MAX_EPISODE_BYTES)."""
    big = _generation("g1").model_copy(update={"prompt_text": "p" * 3_500_000})
    generations = [encode(_generation("g0")), encode(big), encode(_generation("g2"))]
    feedback = [encode(_feedback(f"f{i}", f"g{i}")) for i in range(3)]
    feedback[1] = feedback[1].replace(b'"the answers"', b'"' + b"e" * 900_000 + b'"')
    p = Pipeline(tmp_path)
    p.run(generations, feedback)
    assert p.dead == [] and len(p.reward_values) == 3
    assert MAX_RECORD_BYTES < max(len(v) for v in p.episode_values) <= MAX_EPISODE_BYTES
    episodes = pq.read_table(p.episodes.files()).to_pandas().set_index("generation_id")
    assert len(episodes.loc["g1", "prompt_text"]) == 3_500_000
    assert len(episodes.loc["g1", "edited_text"]) == 900_000
    assert sum(len(pq.read_table(f)) for f in p.rewards.files()) == 3


def test_a_generation_that_outgrows_its_limit_when_re_encoded_is_dead_lettered(tmp_path):
    """The stage stores a generation re-encoded, and numbers written out in full grow: a logprob
    of -1e9 is 13 bytes then. A 2.8 MB generation made a 6.4 MB episode, one over its limit (and,
    larger still, over the produce limit: its send failed on every turn and held the outbox back)."""
    n = 400_000
    generations = [encode(_generation(f"g{i}")) for i in range(3)]
    feedback = [encode(_feedback(f"f{i}", f"g{i}")) for i in range(3)]
    old = b'"completion_token_ids":[5,6,7],"logprobs":[-0.5,-1.0,-0.1]'
    assert old in generations[1]
    generations[1] = generations[1].replace(old, b'"completion_token_ids":[' + b",".join([b"1"] * n)
                                            + b'],"logprobs":[' + b",".join([b"-1e9"] * n) + b"]")
    assert len(generations[1]) < MAX_RECORD_BYTES < len(encode(decode(GenerationEvent, generations[1])))
    p = Pipeline(tmp_path)
    p.run(generations, feedback)
    assert Counter((d.stage, d.reason) for d in p.dead) == {("ingest", "oversized"): 1, ("ingest", "orphan_feedback"): 1}
    (big,) = [d for d in p.dead if d.reason == "oversized"]
    assert (big.source_topic, big.source_offset, big.truncated) == (T.generations, 1, False)
    assert "once re-encoded" in big.detail and base64.b64decode(big.value_b64) == generations[1]
    assert len(p.reward_values) == 2 and all(len(v) <= MAX_EPISODE_BYTES for v in p.episode_values)


def test_records_too_large_to_quote_get_a_dead_letter_that_can_be_sent(tmp_path):
    """A dead letter quotes its record in base64 (4/3 of it): quoted whole, a record of 6.3 MB made
    one over the 8 MiB produce limit, its send failed, and the outbox retried it forever."""
    generations = [encode(_generation(f"g{i}")) for i in range(3)]
    feedback = [encode(_feedback(f"f{i}", f"g{i}")) for i in range(3)]
    generations[1] = generations[1].replace(b'"prompt_text":"p"', b'"prompt_text":"' + b"p" * 9_000_000 + b'"')
    feedback[2] = feedback[2].replace(b'"the answers"', b'"' + b"e" * 1_200_000 + b'"')  # over MAX_FEEDBACK_BYTES
    p = Pipeline(tmp_path)
    p.run(generations, feedback)
    reasons = sorted((d.reason, d.source_topic, d.truncated) for d in p.dead)
    assert reasons == [("orphan_feedback", T.feedback, False), ("oversized", T.feedback, False),
                       ("oversized", T.generations, True)]
    assert len(p.reward_values) == 1  # g0; g2 closed with no signal
    (big,) = [d for d in p.dead if d.truncated]
    assert len(encode(big)) < 8 * 1024 * 1024 - 64 * 1024
    assert "value 9000" in big.detail and base64.b64decode(big.value_b64) == generations[1][:64 * 1024]
    (whole,) = [d for d in p.dead if d.reason == "oversized" and not d.truncated]
    assert base64.b64decode(whole.value_b64) == feedback[2]  # a record a stage could accept is quoted whole


def test_thousands_of_mangled_records_never_fail_a_batch(tmp_path):
    """Seeded, so a failure reproduces."""
    rng = random.Random(20261121)
    generations, feedback, episodes = [], [], []
    for i in range(600):
        g, f = encode(_generation(f"g{i}")), encode(_feedback(f"f{i}", f"g{i}"))
        generations.append(_mutate(g, rng) if i % 2 else g)
        feedback.append(_mutate(f, rng) if i % 3 == 0 else f)
    for i in range(600):  # episodes from some other producer, mangled down to the generation inside
        valid = episode_bytes(encode(_generation(f"e{i}")), resolve([_feedback(f"x{i}", f"e{i}")]), NOW)
        episodes.append((b"e%d" % i, _mutate(valid, rng)))
    p = Pipeline(tmp_path)
    p.run(generations, feedback, episodes)  # raises if any record fails the batch
    _assert_every_record_accounted_for(p, generations, feedback, episodes)
    reasons = Counter(d.reason for d in p.dead)
    assert reasons["invalid"] > 100 and reasons["undecodable"] > 10, reasons
    assert set(reasons) <= {"undecodable", "invalid", "wrong_kind", "unknown_version", "wrong_key",
                            "empty", "late_feedback", "orphan_feedback", "reused_feedback_id", "clock_skew",
                            "labeler_error"}
    # valid generations (the even ones) whose feedback is valid too were joined and labeled
    labeled = {decode(RewardEvent, v).generation_id for v in p.reward_values}
    assert {f"g{i}" for i in range(0, 600, 2) if i % 3} <= labeled
    archived = sum(len(pq.read_table(f)) for f in p.rewards.files())
    assert archived == len(p.reward_values)


#: The reasons a record is refused at a stage's edge, before any join or labeling.
EDGE_REASONS = {"empty", "oversized", "undecodable", "wrong_kind", "unknown_version", "invalid", "wrong_key",
                "clock_skew"}


def _edge_verdict(cls, key: bytes, raw: bytes, max_bytes: int = MAX_RECORD_BYTES, skew_field: str | None = None):
    """What the stage's edge makes of a record: (its reason, None) or (None, the event); the
    contract's own decode, so only the routing of each verdict is under test."""
    try:
        event = decode(cls, raw, max_bytes=max_bytes)
    except ContractError as exc:
        return exc.reason, None
    if key != event.generation_id.encode("utf-8", "surrogatepass"):
        return "wrong_key", None
    if skew_field and is_from_future(getattr(event, skew_field), NOW, IngestSettings().max_future_s):
        return "clock_skew", None
    return None, event


def _assert_every_record_accounted_for(p: Pipeline, generations, feedback, episodes) -> None:
    """Each input record is refused at the edge exactly when its own verdict says so, with that
    reason, once; every generation that passes becomes one episode, and every feedback record
    that passes is folded into one or dead-lettered once."""
    expected = Counter()
    passed_gens, passed_fbs = set(), {}
    for i, raw in enumerate(generations):
        reason, event = _edge_verdict(GenerationEvent, b"g%d" % i, raw, skew_field="completed_at")
        if reason:
            expected[(T.generations, i, reason)] += 1
        else:
            passed_gens.add(event.generation_id)
    for i, raw in enumerate(feedback):
        reason, event = _edge_verdict(FeedbackEvent, b"g%d" % i, raw, MAX_FEEDBACK_BYTES, "created_at")
        if reason:
            expected[(T.feedback, i, reason)] += 1
        else:
            passed_fbs[i] = event.feedback_id  # by offset: two mangled records may carry one id
    n_eps = len(p.episode_values)
    for i, (key, raw) in enumerate(episodes):
        reason, _ = _edge_verdict(EpisodeEvent, key, raw, MAX_EPISODE_BYTES)
        if reason:
            expected[(T.episodes, n_eps + i, reason)] += 1
    edge = Counter((d.source_topic, d.source_offset, d.reason) for d in p.dead if d.reason in EDGE_REASONS)
    assert edge == expected
    eps = [decode(EpisodeEvent, v, max_bytes=MAX_EPISODE_BYTES) for v in p.episode_values]
    assert sorted(e.generation_id for e in eps) == sorted(passed_gens)
    folded = [f for e in eps for f in e.feedback_ids]
    refused = [(d.reason, d.source_offset) for d in p.dead
               if d.source_topic == T.feedback and d.reason not in EDGE_REASONS]
    assert {r for r, _ in refused} <= {"late_feedback", "orphan_feedback", "reused_feedback_id"}
    assert len(folded) == len(set(folded)) and len(refused) == len(set(refused))
    assert {o for _, o in refused} <= set(passed_fbs)
    assert sorted(folded + [passed_fbs[o] for _, o in refused]) == sorted(passed_fbs.values())
