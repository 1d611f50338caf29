"""The reward stage's stream logic: episodes -> labeled, guarded rewards, exactly once.

It runs on the stream runtime (flywheel/stream/): per batch, one state-store transaction holds
the dedupe set, the per-user guard counts, the input offsets and the outbox of rewards and dead
letters; a restart resumes from the stored offsets and sends what the outbox still owes. The
dedupe set is what makes an episode delivered twice (ingest's outbox is at least once) count once.
Both are kept per shard (the episodes partition: a repeat of an episode lands on its original's),
so that in a store shared by several replicas a shard's dedupe ids and counts move with it.

What becomes of each episode:

- undecodable / invalid / wrong key: dead letter with the reason;
- a labeler failed on it (raised, or gave a component that is not finite), or its components
  and the guards' penalties add up to a reward that is not finite: dead letter
  ``labeler_error`` naming the labeler(s), not marked labeled, so its replay is labeled;
- a generation_id already labeled: dropped and counted (``reward_duplicates_total``);
- timed out (no user signal): counted as ``reward_skipped_total{reason="no_signal"}`` and not
  emitted, unless ``reward.emit_ignored`` (then labeled with ``ignore_value``; of the user
  guards only the generation user's share cap applies: no user sent it). Without a signal there
  is nothing to learn from, and an ``ignore`` reward of 0 would only dilute the batch;
- otherwise exactly one :class:`RewardEvent`, keyed by generation_id, also archived to Parquet.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Histogram

from flywheel.contracts import ABUSE_FLAGS, HACKING_FLAGS, MAX_EPISODE_BYTES, EpisodeEvent, Topics
from flywheel.settings import RewardSettings
from flywheel.stream.runner import KEYED_DECODE_REASONS, OutboxDeadLetters, decode_keyed
from flywheel.stream.store import StateStore
from flywheel.telemetry import Tracing, carried
from reward.guards import (
    UserWindow,
    Verdict,
    judge_sample,
    judge_unrated,
    judge_user,
    window_of,
)
from reward.labelers import LabelerError, build_labeler

# A user's counts per shard and guard window; a window's totals are sums over them ("user" is
# quoted: a reserved word in PostgreSQL).
_USER_WIN = """
CREATE TABLE IF NOT EXISTS user_win (shard INTEGER NOT NULL, win INTEGER NOT NULL, "user" TEXT NOT NULL,
    n INTEGER NOT NULL, kept INTEGER NOT NULL, accept INTEGER NOT NULL, reject INTEGER NOT NULL,
    edit INTEGER NOT NULL, ignore INTEGER NOT NULL, PRIMARY KEY (shard, win, "user"));
"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (gid TEXT PRIMARY KEY, at REAL NOT NULL, shard INTEGER);
CREATE INDEX IF NOT EXISTS seen_age ON seen (at);
CREATE TABLE IF NOT EXISTS reached (shard INTEGER PRIMARY KEY, win INTEGER NOT NULL);
""" + _USER_WIN

log = logging.getLogger(__name__)

REWARDS_ARCHIVE = "rewards"
#: Every reason this stage dead-letters a record for.
DEADLETTER_REASONS: tuple[str, ...] = (*KEYED_DECODE_REASONS, "labeler_error")
#: Position of each signal's count in a cached user_win row [n, kept, accept, reject, edit, ignore].
_SIGNAL_COL = {"accept": 2, "reject": 3, "edit": 4, "ignore": 5}


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rewards = Counter("reward_rewards_total", "Rewards emitted, by signal", ["signal"], registry=registry)
        self.value = Histogram("reward_value_reward", "Scalar reward of emitted samples, by signal",
                               ["signal"], buckets=(-1, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1), registry=registry)
        self.guards = Counter("reward_guard_actions_total", "Samples flagged by a guard, by flag",
                              ["flag"], registry=registry)
        # once per sample, however many of a kind's flags it carries: the alerts' share of samples
        self.flagged = Counter("reward_flagged_samples_total",
                               "Samples with at least one flag of a kind: abuse (the user) or hacking (the completion)",
                               ["kind"], registry=registry)
        # every series from the start, so that rate() sees a flag's first burst
        for flag in (*ABUSE_FLAGS, *HACKING_FLAGS):
            self.guards.labels(flag)
        for kind in ("abuse", "hacking"):
            self.flagged.labels(kind)
        self.duplicates = Counter("reward_duplicates_total", "Episodes already labeled", registry=registry)
        self.skipped = Counter("reward_skipped_total", "Episodes not labeled, by reason", ["reason"],
                               registry=registry)
        self.skipped.labels("no_signal")


class RewardStage:
    """Implements :class:`flywheel.stream.runner.Stage` for episodes -> rewards."""

    def __init__(self, cfg: RewardSettings, topics: Topics, store: StateStore,
                 registry: CollectorRegistry, tracing: Tracing | None = None) -> None:
        self.cfg, self.topics, self.store, self.db = cfg, topics, store, store.db
        self.tracing = tracing if tracing is not None else Tracing()
        self.label = build_labeler(cfg)
        self.dead = OutboxDeadLetters(store, topics.deadletter, "reward", registry, DEADLETTER_REASONS)
        self.m = RewardMetrics(registry)
        self._last_prune = 0.0
        self._children: dict[tuple[Counter, str], Counter] = {}
        #: (signal, sample flags, user flags) -> samples of the batch in hand (_export_tally)
        self._tally: dict[tuple[str, tuple[str, ...], tuple[str, ...]], int] = {}
        self._rewards: list[tuple[str, float]] = []  # (signal, reward) of the batch in hand
        _migrate(store)
        self._check_guard_window()
        self._load_counts()
        store.on_rollback(self._load_counts)

    def shards_changed(self, owned: set[int]) -> None:
        """The runner's hook: in a shared store, count over the shards owned now (their counts
        are loaded, those of shards gone are dropped); a store of its own holds only this
        process's counts, all loaded already."""
        if self.store.shared:
            self._load_counts()

    def _check_guard_window(self) -> None:
        """Start the guard counts afresh when ``reward.guard_window_s`` changed since they were kept.

        Windows are stored as numbers (``created_at // guard_window_s``): counted in another width,
        they are other windows. Kept as they were, a widened window made each shard look many
        windows further on than it is, and every prune deleted the counts still filling (the share
        cap stopped binding); a narrowed one held stale counts. The current window's shares start
        from zero once, which the warning says.
        """
        want = repr(self.cfg.guard_window_s)
        row = self.db.execute("SELECT v FROM meta WHERE k='guard_window_s'").fetchone()
        if row is not None and row[0] == want:
            return
        with self.store.txn():
            if row is not None:
                log.warning("reward.guard_window_s changed from %s to %s s: guard counts start afresh", row[0], want)
                for table in ("reached", "user_win"):
                    self.db.execute(f"DELETE FROM {table}")
            self.db.execute("INSERT INTO meta VALUES ('guard_window_s', ?) ON CONFLICT (k) DO UPDATE SET v=excluded.v",
                            (want,))

    def process(self, records: list[ConsumerRecord], now: float) -> None:
        self._tally.clear()  # (what a batch that failed part way counted is not exported)
        self._rewards.clear()
        episodes = []
        latest: dict[int, float] = {}  # shard -> latest generation time in this batch
        for rec in records:
            # (a dead letter for this record is a row of its partition's outbox: OutboxDeadLetters)
            if (ep := decode_keyed(EpisodeEvent, rec, self.dead, MAX_EPISODE_BYTES)) is not None:
                episodes.append((rec, ep))
                latest[rec.partition] = max(latest.get(rec.partition, 0.0), ep.generation.created_at)
        self._note_reached(latest, now)
        seen = self._seen_of([ep.generation_id for _, ep in episodes])
        fresh: list[tuple[str, float]] = []
        for rec, ep in episodes:
            if ep.generation_id in seen:
                self.m.duplicates.inc()
                continue
            if ep.timed_out and not self.cfg.emit_ignored:
                self.m.skipped.labels("no_signal").inc()
            else:
                # the reward carries the episode's request id and trace on (flywheel/telemetry.py)
                with self.tracing.record_span("reward label", carried(rec.headers),
                                              generation_id=ep.generation_id) as headers:
                    try:
                        reward = self.label_episode(ep, now, rec.partition)
                    except LabelerError as exc:
                        # not marked seen: a replay, once the labeler is fixed, is labeled
                        self.dead.send_record(rec, "labeler_error", str(exc))
                        continue
                    self.store.append(rec.partition, self.topics.rewards, ep.generation_id, reward,
                                      archive=REWARDS_ARCHIVE, headers=headers)
            seen.add(ep.generation_id)
            fresh.append((ep.generation_id, now, rec.partition))
        # DO NOTHING: on a shared store a gid can meet another replica's only where the partition
        # count changed under a running stage; that repeat is dropped by the trainer, by key
        self.db.executemany("INSERT INTO seen (gid, at, shard) VALUES (?, ?, ?) ON CONFLICT (gid) DO NOTHING", fresh)
        self._write_counts()
        self._export_tally()

    def _seen_of(self, gids: list[str]) -> set[str]:
        """The ids among ``gids`` labeled before: one query per chunk, not one per record."""
        found: set[str] = set()
        for i in range(0, len(gids), 500):  # stay well under SQLite's bound-parameter limit
            chunk = gids[i:i + 500]
            marks = ",".join("?" * len(chunk))
            found.update(r[0] for r in self.db.execute(f"SELECT gid FROM seen WHERE gid IN ({marks})", chunk))
        return found

    def label_episode(self, ep: EpisodeEvent, now: float, shard: int) -> bytes:
        """The episode's reward record, encoded (see :func:`reward_bytes`); ``shard``: its partition."""
        g = ep.generation
        components = self.label(ep)
        extra, sample_flags = judge_sample(g.completion_token_ids, self.cfg, g.completion_text)
        components.update(extra)  # (labelers may not use these names: reward/labelers.py)
        reward = self._total(components, extra)  # before the guards count it: failed, it counts nowhere
        verdict = self._judge_unrated(ep, shard) if ep.timed_out else self._judge_rater(ep, shard)
        key = (ep.signal, sample_flags, verdict.flags)
        self._tally[key] = self._tally.get(key, 0) + 1
        self._rewards.append((ep.signal, reward))
        return reward_bytes(ep, reward, components, verdict.weight, sample_flags + verdict.flags, now)

    def _export_tally(self) -> None:
        """Export the batch's samples once it is processed: counters once per kind of sample, not
        once per sample (each ``inc`` takes a lock; a batch holds thousands of samples of a few
        kinds), and each reward to the histogram."""
        for (signal, sample_flags, user_flags), n in self._tally.items():
            self._child(self.m.rewards, signal).inc(n)
            for flag in sample_flags + user_flags:
                self._child(self.m.guards, flag).inc(n)
            if sample_flags:
                self._child(self.m.flagged, "hacking").inc(n)
            if user_flags:
                self._child(self.m.flagged, "abuse").inc(n)
        for signal, reward in self._rewards:
            self._child(self.m.value, signal).observe(reward)
        self._tally.clear()
        self._rewards.clear()

    def _total(self, components: dict[str, float], penalties: dict[str, float]) -> float:
        """The reward: the sum of the labelers' components and the guards' penalties.

        The labelers' own sum is checked finite (reward/labelers.py), but the penalties come
        after it: a total past float's range would go on the wire as null, which the rewards
        archive refuses on every write of its queue. It fails its episode as a labeler does.
        """
        reward = float(sum(components.values()))
        if not math.isfinite(reward):
            raise LabelerError(" + ".join((*self.cfg.labelers, *penalties)),
                               f"components add up to {reward}, not a finite reward")
        return reward

    def _judge_rater(self, ep: EpisodeEvent, shard: int) -> Verdict:
        """Count the episode's signal against whoever sent it, and judge them (reward/guards.py)."""
        g = ep.generation
        win = window_of(g.created_at, self.cfg)
        rater = ep.rater_id or g.user_id
        verdict = judge_user(self._count_user(shard, rater, win, ep.signal), self.cfg)
        if "user_cap" not in verdict.flags:
            self._keep(shard, win, rater)
        return verdict

    def _judge_unrated(self, ep: EpisodeEvent, shard: int) -> Verdict:
        """A timed-out episode: only its generation user's share cap (reward/guards.py). Counted
        as a signal, a user whose generations time out would be flagged ``constant_user``, and
        their real signals judged, for signals they never gave."""
        g = ep.generation
        win, user = window_of(g.created_at, self.cfg), g.user_id
        counts = self._users.get((win, user))
        verdict = judge_unrated(counts[1] if counts else 0, self._wins.setdefault(win, [0, 0, 0])[2], self.cfg)
        if not verdict.flags:
            self._keep(shard, win, user)  # a kept sample, no signal: not one of the window's signalling users
        return verdict

    def _keep(self, shard: int, win: int, user: str) -> None:
        """Count a sample that reaches training toward its user's and its window's kept samples."""
        self._users.setdefault((win, user), [0, 0, 0, 0, 0, 0])[1] += 1
        self._by_shard.setdefault((shard, win, user), [0, 0, 0, 0, 0, 0])[1] += 1
        self._wins[win][2] += 1
        self._dirty.add((shard, win, user))

    def _child(self, metric: Any, label: str) -> Any:
        """``metric.labels(label)``, cached: labels() takes a lock and builds a key per call."""
        child = self._children.get((metric, label))
        if child is None:
            child = self._children[(metric, label)] = metric.labels(label)
        return child

    # -- guard counts -----------------------------------------------------------------------
    # The counts live in user_win, per shard (the truth, committed with the batch), and in these
    # dicts (a cache, so judging a sample costs no SQL): per shard, to write back, and summed over
    # the process's shards, which the guards judge. The cache is loaded from the table at start,
    # after a rolled-back batch and when the process's shards change, and the rows a batch changed
    # are written back in its transaction, so a restart or a failed batch sees exactly the
    # committed counts.
    def _load_counts(self) -> None:
        cond, mine = self.store.scoped()
        #: shard -> (latest guard window its episodes reached, when; None: not since loading).
        #: See :meth:`_prune_counts`.
        self._reached: dict[int, tuple[int, float | None]] = {
            shard: (win, None) for shard, win in self.db.execute(f"SELECT shard, win FROM reached WHERE 1=1{cond}",
                                                                 mine)}
        self._by_shard: dict[tuple[int, int, str], list[int]] = {
            (s, w, u): list(rest) for s, w, u, *rest in self.db.execute(
                f'SELECT shard, win, "user", n, kept, accept, reject, edit, ignore FROM user_win WHERE 1=1{cond}', mine)}
        self._users: dict[tuple[int, str], list[int]] = {}
        for (_, w, u), counts in self._by_shard.items():
            total = self._users.setdefault((w, u), [0, 0, 0, 0, 0, 0])
            for i, c in enumerate(counts):
                total[i] += c
        # [samples, users with a signal, kept samples] of each window
        self._wins: dict[int, list[int]] = {}
        for (w, _), (n, kept, *_) in self._users.items():
            tot = self._wins.setdefault(w, [0, 0, 0])
            tot[0] += n
            tot[1] += n > 0
            tot[2] += kept
        self._dirty: set[tuple[int, int, str]] = set()

    def _count_user(self, shard: int, user: str, win: int, signal: str) -> UserWindow:
        """Add this sample to the user's and the window's counts; return the counts after it."""
        col = _SIGNAL_COL.get(signal, _SIGNAL_COL["ignore"])
        counts = self._users.get((win, user))
        tot = self._wins.setdefault(win, [0, 0, 0])
        if counts is None:
            counts = self._users[(win, user)] = [0, 0, 0, 0, 0, 0]
        if counts[0] == 0:  # the user's first signal in the window (timed-out samples are none)
            tot[1] += 1
        counts[0] += 1
        counts[col] += 1
        tot[0] += 1
        mine = self._by_shard.setdefault((shard, win, user), [0, 0, 0, 0, 0, 0])
        mine[0] += 1
        mine[col] += 1
        self._dirty.add((shard, win, user))
        n, kept, a, r, e, i = counts
        return UserWindow(n, kept, tot[0], tot[1], {"accept": a, "reject": r, "edit": e, "ignore": i}, tot[2])

    def _write_counts(self) -> None:
        if not self._dirty:
            return
        self.db.executemany(
            "INSERT INTO user_win VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (shard, win, \"user\") DO UPDATE SET "
            "n=excluded.n, kept=excluded.kept, accept=excluded.accept, reject=excluded.reject, "
            "edit=excluded.edit, ignore=excluded.ignore",
            [(s, w, u, *self._by_shard[(s, w, u)]) for s, w, u in self._dirty])
        self._dirty.clear()

    def _note_reached(self, latest: dict[int, float], now: float) -> None:
        # never past the wall clock's window: one generation stamped by a clock far in the future
        # would otherwise prune every window still filling
        ceiling = window_of(now, self.cfg)
        for shard, generated_at in latest.items():
            win = min(window_of(generated_at, self.cfg), ceiling)
            last = self._reached.get(shard)
            self._reached[shard] = (win if last is None else max(win, last[0]), now)
        if latest:
            self.db.executemany("INSERT INTO reached VALUES (?, ?) ON CONFLICT (shard) DO UPDATE SET win=excluded.win",
                                [(shard, self._reached[shard][0]) for shard in latest])

    def tick(self, shards: set[int], now: float) -> None:
        if now - self._last_prune < 60:
            return
        self._last_prune = now
        cond, mine = self.store.scoped()
        self.db.execute(f"DELETE FROM seen WHERE at<?{cond}", (now - self.cfg.dedupe_retention_s, *mine))
        self._prune_counts(now)

    def _prune_counts(self, now: float) -> None:
        """Forget guard counts of windows no episode will fall in any more.

        Judged by event time, not the wall clock: a backlog hours old (after an outage, or a
        replay) is judged against counts that accumulate as they did live, rather than restart
        at every prune. A window is done once every shard in flight has moved more than two
        windows past it (episodes come late by up to ingest's join window). How far each shard has
        moved is kept in the state store (table ``reached``), so a restart knows of a shard still
        behind before it reads from it. A shard is in flight until it has sent no episode for a
        guard window while this process ran (the clock of a shard loaded from the store starts at
        the first turn after loading): a revoked or idle shard stops holding counts back. With
        none in flight nothing is pruned: an idle process's counts do not grow.
        """
        limit = self.cfg.guard_window_s
        live = {s: (win, now if at is None else at) for s, (win, at) in self._reached.items()}
        self._reached = {s: r for s, r in live.items() if now - r[1] < limit}
        if len(self._reached) < len(live):
            self.db.executemany("DELETE FROM reached WHERE shard=?", [(s,) for s in live.keys() - self._reached.keys()])
        if not self._reached:
            return
        # never past the wall clock's window either: a shard that reached a window while the clock
        # ran ahead (a wrong clock, corrected since) must not prune the window filling now
        oldest = min(window_of(now, self.cfg), *(win for win, _ in self._reached.values())) - 2
        cond, mine = self.store.scoped()
        self.db.execute(f"DELETE FROM user_win WHERE win<?{cond}", (oldest, *mine))
        self._users = {k: v for k, v in self._users.items() if k[0] >= oldest}
        self._by_shard = {k: v for k, v in self._by_shard.items() if k[1] >= oldest}
        self._wins = {w: v for w, v in self._wins.items() if w >= oldest}


_encode_json = msgspec.json.Encoder().encode


def _migrate(store: StateStore) -> None:
    """Bring a store written by an earlier version up to this one's tables.

    Guard counts from before they were kept per shard were the process's over all its shards:
    they move to shard -1, counted with the rest (a store of its own loads every shard's);
    ``win_tot`` is now summed from them. Dedupe ids from before have no shard: pruned by age alike.
    """
    if "shard" in store.columns("user_win") and "shard" in store.columns("seen"):
        return
    # replicas starting together each find them missing: one at a time, reading them again
    with store.schema_change():
        if "shard" not in store.columns("user_win"):
            store.db.execute("ALTER TABLE user_win RENAME TO user_win_unsharded")
            store.db.execute(_USER_WIN.strip().rstrip(";"))
            store.db.execute('INSERT INTO user_win SELECT -1, win, "user", n, kept, accept, reject, edit, ignore '
                             "FROM user_win_unsharded")
            store.db.execute("DROP TABLE user_win_unsharded")
            store.db.execute("DROP TABLE IF EXISTS win_tot")
        if "shard" not in store.columns("seen"):
            store.add_column("seen", "shard", "INTEGER")


def reward_bytes(ep: EpisodeEvent, reward: float, components: dict[str, float], weight: float,
                 flags: tuple[str, ...], labeled_at: float) -> bytes:
    """``encode(RewardEvent(...))`` for ``ep``, written straight from its fields.

    Every field comes from an episode validated at the edge or from this stage's own arithmetic,
    so building the pydantic model only to serialise it would validate everything twice (two
    thirds of the labeling cost). The field order is RewardEvent's;
    tests/unit/test_reward_rules.py checks the bytes are those of the model-built record.
    """
    g = ep.generation
    return _encode_json({
        "schema_version": 1, "kind": "reward", "generation_id": g.generation_id,
        "group_id": g.group_id, "user_id": g.user_id, "rater_id": ep.rater_id, "model_version": g.model_version,
        "signal": ep.signal, "prompt_token_ids": g.prompt_token_ids,
        "completion_token_ids": g.completion_token_ids, "logprobs": g.logprobs,
        "sampling": g.sampling.wire(), "reward": reward, "components": components,
        "weight": weight, "flags": flags, "generated_at": g.created_at, "labeled_at": labeled_at,
    })
