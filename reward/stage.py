"""The reward stage's stream logic: episodes -> labeled, guarded rewards, exactly once.

It runs on the same exactly-once machinery as ingest (ingest/exactly_once.py, ingest/runner.py):
per batch, one SQLite transaction holds the dedupe set, the per-user guard counts, the input
offsets and the outbox of rewards and dead letters; a restart resumes from the stored offsets and
settles the outbox by reading the rewards topic back.

What becomes of each episode:

- undecodable / invalid / wrong key: dead letter with the reason;
- a generation_id already labeled: dropped and counted (``reward_duplicates_total``);
- timed out (no user signal): counted as ``reward_skipped_total{reason="no_signal"}`` and not
  emitted, unless ``reward.emit_ignored`` (then labeled with ``ignore_value``). Without a signal
  there is nothing to learn from, and an ``ignore`` reward of 0 would only dilute the batch;
- otherwise exactly one :class:`RewardEvent`, keyed by generation_id, also archived to Parquet.
"""

from __future__ import annotations

from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Histogram

from flywheel.bus import DeadLetters
from flywheel.contracts import ContractError, EpisodeEvent, RewardEvent, Topics, decode, encode
from flywheel.settings import RewardSettings
from ingest.exactly_once import StateStore
from ingest.runner import OutboxSink
from reward.guards import UserWindow, judge_sample, judge_user, window_of
from reward.labelers import build_labeler

SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (gid TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS seen_age ON seen (at);
CREATE TABLE IF NOT EXISTS user_win (win INTEGER NOT NULL, user TEXT NOT NULL, n INTEGER NOT NULL,
    kept INTEGER NOT NULL, accept INTEGER NOT NULL, reject INTEGER NOT NULL, edit INTEGER NOT NULL, ignore INTEGER NOT NULL,
    PRIMARY KEY (win, user));
CREATE TABLE IF NOT EXISTS win_tot (win INTEGER PRIMARY KEY, n INTEGER NOT NULL, users INTEGER NOT NULL);
"""

REWARDS_ARCHIVE = "rewards"
#: Labeled generation ids are remembered this long to drop upstream duplicates.
DEDUPE_RETENTION_S = 86_400.0


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rewards = Counter("reward_rewards_total", "Rewards emitted, by signal", ["signal"], registry=registry)
        self.value = Histogram("reward_value_reward", "Scalar reward of emitted samples",
                               buckets=(-1, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1), registry=registry)
        self.guards = Counter("reward_guard_actions_total", "Samples flagged by a guard, by flag",
                              ["flag"], registry=registry)
        self.duplicates = Counter("reward_duplicates_total", "Episodes already labeled", registry=registry)
        self.skipped = Counter("reward_skipped_total", "Episodes not labeled, by reason", ["reason"],
                               registry=registry)


class RewardStage:
    """Implements :class:`ingest.runner.Stage` for episodes -> rewards."""

    def __init__(self, cfg: RewardSettings, topics: Topics, store: StateStore,
                 registry: CollectorRegistry) -> None:
        self.cfg, self.topics, self.store, self.db = cfg, topics, store, store.db
        self.label = build_labeler(cfg)
        self.sink = OutboxSink(store)
        self.dead = DeadLetters(self.sink, topics.deadletter, "reward", registry)
        self.m = RewardMetrics(registry)
        self._last_prune = 0.0

    def process(self, records: list[ConsumerRecord], now: float) -> None:
        for rec in records:
            self.sink.shard = rec.partition
            ep = self._decode(rec)
            if ep is None:
                continue
            if self.db.execute("SELECT 1 FROM seen WHERE gid=?", (ep.generation_id,)).fetchone():
                self.m.duplicates.inc()
                continue
            self.db.execute("INSERT INTO seen VALUES (?, ?)", (ep.generation_id, now))
            if ep.timed_out and not self.cfg.emit_ignored:
                self.m.skipped.labels("no_signal").inc()
                continue
            reward = self.label_episode(ep, now)
            self.store.append(rec.partition, self.topics.rewards, ep.generation_id, encode(reward),
                              archive=REWARDS_ARCHIVE)

    def _decode(self, rec: ConsumerRecord) -> EpisodeEvent | None:
        try:
            ep = decode(EpisodeEvent, rec.value)
        except ContractError as exc:
            self.dead.send_record(rec, exc.reason, exc.detail)
            return None
        key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
        if key != ep.generation_id:
            self.dead.send_record(rec, "wrong_key", f"key {key!r} is not the generation_id {ep.generation_id!r}")
            return None
        return ep

    def label_episode(self, ep: EpisodeEvent, now: float) -> RewardEvent:
        g = ep.generation
        components = self.label(ep)
        extra, sample_flags = judge_sample(g.completion_token_ids, self.cfg)
        components.update(extra)
        win = window_of(g.created_at, self.cfg)
        verdict = judge_user(self._count_user(g.user_id, win, ep.signal), self.cfg)
        if "user_cap" not in verdict.flags:
            self.db.execute("UPDATE user_win SET kept=kept+1 WHERE win=? AND user=?", (win, g.user_id))
        flags = sample_flags + verdict.flags
        reward = sum(components.values())
        for flag in flags:
            self.m.guards.labels(flag).inc()
        self.m.rewards.labels(ep.signal).inc()
        self.m.value.observe(reward)
        return RewardEvent(
            generation_id=g.generation_id, group_id=g.group_id, user_id=g.user_id,
            model_version=g.model_version, signal=ep.signal, prompt_token_ids=g.prompt_token_ids,
            completion_token_ids=g.completion_token_ids, logprobs=g.logprobs, sampling=g.sampling,
            reward=reward, components=components, weight=verdict.weight, flags=flags,
            generated_at=g.created_at, labeled_at=now,
        )

    def _count_user(self, user: str, win: int, signal: str) -> UserWindow:
        """Add this sample to the user's and the window's counts; return the counts after it."""
        col = signal if signal in ("accept", "reject", "edit", "ignore") else "ignore"
        new_user = self.db.execute("SELECT 1 FROM user_win WHERE win=? AND user=?", (win, user)).fetchone() is None
        self.db.execute(
            "INSERT INTO user_win VALUES (?, ?, 1, 0, 0, 0, 0, 0) ON CONFLICT (win, user) DO UPDATE SET n=n+1",
            (win, user))
        self.db.execute(f"UPDATE user_win SET {col}={col}+1 WHERE win=? AND user=?", (win, user))
        self.db.execute(
            "INSERT INTO win_tot VALUES (?, 1, 1) ON CONFLICT (win) DO UPDATE SET n=n+1, users=users+?",
            (win, int(new_user)))
        n, kept, a, r, e, i = self.db.execute(
            "SELECT n, kept, accept, reject, edit, ignore FROM user_win WHERE win=? AND user=?",
            (win, user)).fetchone()
        total, users = self.db.execute("SELECT n, users FROM win_tot WHERE win=?", (win,)).fetchone()
        return UserWindow(n, kept, total, users, {"accept": a, "reject": r, "edit": e, "ignore": i})

    def tick(self, shards: set[int], now: float) -> None:
        if now - self._last_prune < 60:
            return
        self._last_prune = now
        self.db.execute("DELETE FROM seen WHERE at<?", (now - DEDUPE_RETENTION_S,))
        oldest = window_of(now, self.cfg) - 2
        self.db.execute("DELETE FROM user_win WHERE win<?", (oldest,))
        self.db.execute("DELETE FROM win_tot WHERE win<?", (oldest,))
