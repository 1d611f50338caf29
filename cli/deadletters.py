"""``flywheel deadletters``: summarise, show and replay the dead-letter topic.

Every stage sends what it cannot use to ``<prefix>deadletter`` as a :class:`DeadLetterEvent`
with the reason and the original key and bytes (flywheel/stream/deadletters.py). This is the on-call side of
that promise (runbook: dashboards/runbooks/dead-letters.md)::

    flywheel deadletters summary [filters]          counts by stage, reason and source topic
    flywheel deadletters show [filters] [--limit N] the records, with their original values
    flywheel deadletters replay [filters] [--dry-run]

Filters: ``--reason R``, ``--stage S``, ``--source-topic T`` (repeatable; a topic by full name or
by kind, e.g. ``feedback``), ``--since 2h`` and ``--until 30m`` (ages of ``failed_at``).

**Replay** sends each selected record's original key and value back to its source topic and
partition, once the cause is fixed: a producer deployed with a contract the consumers now know
(``unknown_version``, ``invalid``) or with its clock fixed (``clock_skew``). Feedback goes first
and is acked before the rest is sent: orphaned feedback (``orphan_feedback``) waits afresh for
its generation, so replayed with the generation it waited for, it joins it. Feedback whose
generation arrived by itself after the feedback was dead-lettered cannot join any more (that
generation closed as ``ignore``, one episode per generation): it comes back as
``late_feedback``. A replayed record carries the header ``flywheel-replay-of:
<partition>:<offset>`` naming its dead letter, and a replay skips the letters whose records an
earlier replay sent: it reads each source partition from the oldest selected letter's record on,
for those headers. Sent again anyway (``--again``), a record still counts once while the stages
remember the ids it carries: ingest folds repeated ``feedback_id``\\ s and ``generation_id``\\ s
of generations closed within ``ingest.closed_retention_s``, reward repeated episodes within
``reward.dedupe_retention_s``; past those, it would count twice. Only records from this
deployment's stage inputs (generations, feedback, episodes, rewards) are replayed; anything else
is listed as refused.
A record that fails again is dead-lettered again, with its new reason; a later replay sends each
distinct record once, however many dead letters it has by then.

The dead-letter topic is read from its start to its high watermark on every run: it is a
low-volume topic, and its retention bounds the read.

``-o json`` prints one JSON object instead of the text (flywheel/output.py), for scripts: the
count line's ``topic``, ``dead_letters``, ``selected``, ``unreadable``, and per action
``summary`` (``rows``: ``stage``, ``reason``, ``source_topic``, ``count``, ``first_failed_at``,
``last_failed_at``; ``repeats``), ``show`` (``letters``: :func:`letter_json`, at most ``--limit``)
or ``replay`` (``dry_run``, ``sent``: ``source_topic``, ``reason``, ``count``; ``sent_total``,
``before``, ``repeats``, ``refused``: ``partition``, ``offset``, ``reason``, ``why``).
"""

from __future__ import annotations

import argparse
import base64
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from flywheel.contracts import MAX_DEADLETTER_BYTES, ContractError, DeadLetterEvent, Topics, decode
from flywheel.kafka.clients import make_producer, partitions_of, read_to_end
from flywheel.kafka.security import check_access, kafka_python_options
from flywheel.output import as_json
from flywheel.settings import KafkaSettings, Settings
from flywheel.terminal import escape

REPLAY_HEADER = "flywheel-replay-of"
_REPLAY_OF = re.compile(rb"^(\d+):(\d+)$")
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"2h"``, ``"7d"`` -> seconds (an argparse ``type``)."""
    m = _AGE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not an age: {text!r} (a number and a unit: 90s, 30m, 2h, 7d)")
    return float(m[1]) * _UNIT_S[m[2]]


@dataclass(frozen=True)
class Letter:
    """One dead letter and where it sits in the dead-letter topic."""

    partition: int
    offset: int
    event: DeadLetterEvent


@dataclass(frozen=True)
class Selection:
    """Which dead letters a command acts on; an empty set matches everything."""

    reasons: frozenset[str] = frozenset()
    stages: frozenset[str] = frozenset()
    source_topics: frozenset[str] = frozenset()
    since: float | None = None  # failed_at at or after (epoch seconds)
    until: float | None = None  # failed_at before

    def matches(self, dl: DeadLetterEvent) -> bool:
        return ((not self.reasons or dl.reason in self.reasons)
                and (not self.stages or dl.stage in self.stages)
                and (not self.source_topics or dl.source_topic in self.source_topics)
                and (self.since is None or dl.failed_at >= self.since)
                and (self.until is None or dl.failed_at < self.until))


def selection_from_args(args: argparse.Namespace, topics: Topics, now: float) -> Selection:
    """The command line's filters (ages already in seconds); a source topic may be named by kind
    (``feedback``)."""
    kinds = {"generations": topics.generations, "feedback": topics.feedback,
             "episodes": topics.episodes, "rewards": topics.rewards}
    return Selection(
        reasons=frozenset(args.reason or ()),
        stages=frozenset(args.stage or ()),
        source_topics=frozenset(kinds.get(t, t) for t in args.source_topic or ()),
        since=now - args.since if args.since is not None else None,
        until=now - args.until if args.until is not None else None,
    )


@dataclass
class Summary:
    """Counts of the selected dead letters by (stage, reason, source topic), with time span."""

    rows: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # [n, first, last]
    #: idempotency keys of the letters counted: a letter delivered twice (the stages' outboxes
    #: are at least once) names the same stage, reason and source record, and counts once
    seen: set[tuple[str, str, str, int, int]] = field(default_factory=set)
    repeats: int = 0

    def add(self, dl: DeadLetterEvent) -> None:
        if dl.source_partition is not None and dl.source_offset is not None:
            key = (dl.stage, dl.reason, dl.source_topic, dl.source_partition, dl.source_offset)
            if key in self.seen:
                self.repeats += 1
                return
            self.seen.add(key)
        row = self.rows.get((dl.stage, dl.reason, dl.source_topic))
        if row is None:
            self.rows[(dl.stage, dl.reason, dl.source_topic)] = [1, dl.failed_at, dl.failed_at]
        else:
            row[0] += 1
            row[1], row[2] = min(row[1], dl.failed_at), max(row[2], dl.failed_at)

    def to_json(self) -> dict[str, Any]:
        rows = [{"stage": stage, "reason": reason, "source_topic": topic, "count": int(n),
                 "first_failed_at": first, "last_failed_at": last}
                for (stage, reason, topic), (n, first, last) in sorted(self.rows.items(), key=lambda kv: -kv[1][0])]
        return {"rows": rows, "repeats": self.repeats}

    def render(self) -> str:
        if not self.rows:
            return "no dead letters match"
        table = [("stage", "reason", "source topic", "count", "first failed", "last failed")]
        for (stage, reason, topic), (n, first, last) in sorted(self.rows.items(), key=lambda kv: -kv[1][0]):
            table.append((escape(stage), escape(reason), escape(topic), str(int(n)), _when(first), _when(last)))
        widths = [max(len(row[i]) for row in table) for i in range(6)]
        text = "\n".join("  ".join(cell.rjust(w) if i == 3 else cell.ljust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                         for row in table)
        if self.repeats:
            text += f"\n({self.repeats} repeated deliveries of the same letters not counted)"
        return text


def show(letters: Iterable[Letter], limit: int, width: int = 300) -> str:
    """The letters as an operator reads them: where, why, and the original bytes (truncated)."""
    out = []
    for letter in list(letters)[:limit]:
        dl = letter.event
        value = base64.b64decode(dl.value_b64)
        key = base64.b64decode(dl.key_b64) if dl.key_b64 is not None else None
        text = value.decode("utf-8", "replace")
        # anyone who can write a topic chose these bytes (and the detail quotes them): escaped, so
        # they cannot break lines, send escape sequences or reorder the text (flywheel/terminal.py)
        out.append(
            f"[{letter.partition}:{letter.offset}] {_when(dl.failed_at)} {escape(dl.stage)} {escape(dl.reason)}: "
            f"{escape(dl.detail)}\n"
            f"  from {escape(dl.source_topic)}[{dl.source_partition}]@{dl.source_offset} key={key!r}\n"
            f"  value ({len(value)} bytes): {escape(text[:width])}{' ...' if len(text) > width else ''}")
    return "\n".join(out) if out else "no dead letters match"


def letter_json(letter: Letter) -> dict[str, Any]:
    """A letter for ``show -o json``: where it sits, and its event's fields as they are (the
    original key and value stay base64, whole: JSON carries any bytes, a terminal does not)."""
    dl = letter.event
    return {"partition": letter.partition, "offset": letter.offset, "failed_at": dl.failed_at,
            "stage": dl.stage, "reason": dl.reason, "detail": dl.detail, "source_topic": dl.source_topic,
            "source_partition": dl.source_partition, "source_offset": dl.source_offset,
            "key_b64": dl.key_b64, "value_b64": dl.value_b64, "truncated": dl.truncated}


@dataclass
class ReplayResult:
    sent: Counter[tuple[str, str]] = field(default_factory=Counter)  # (source topic, reason) -> n
    refused: list[tuple[Letter, str]] = field(default_factory=list)
    repeats: int = 0  # letters whose record is already in this replay
    before: int = 0  # letters an earlier replay sent, skipped

    def to_json(self, dry_run: bool) -> dict[str, Any]:
        return {"dry_run": dry_run, "sent_total": sum(self.sent.values()),
                "sent": [{"source_topic": topic, "reason": reason, "count": n}
                         for (topic, reason), n in sorted(self.sent.items())],
                "before": self.before, "repeats": self.repeats,
                "refused": [{"partition": x.partition, "offset": x.offset, "reason": x.event.reason, "why": why}
                            for x, why in self.refused]}

    def render(self, dry_run: bool) -> str:
        verb = "would replay" if dry_run else "replayed"
        lines = [f"{verb} {sum(self.sent.values())} records"]
        lines += [f"  {n:>7}  {escape(reason):<18} -> {escape(topic)}" for (topic, reason), n in sorted(self.sent.items())]
        if self.before:
            lines.append(f"  {self.before} dead letters were replayed before (their records are in the source "
                         f"topic with {REPLAY_HEADER}): skipped; --again sends them anyway")
        if self.repeats:
            lines.append(f"  {self.repeats} more dead letters hold a record above (it was dead-lettered more "
                         "than once): sent once, marked as the replay of each")
        for letter, why in self.refused:
            lines.append(f"  refused [{letter.partition}:{letter.offset}] {escape(letter.event.reason)}: {escape(why)}")
        return "\n".join(lines)


def plan_replay(letters: Iterable[Letter], inputs: frozenset[str], partitions: Mapping[str, int] | None = None,
                ) -> tuple[list[Letter], list[tuple[Letter, str]], dict[tuple[int, int], list[Letter]]]:
    """Split the letters into those to replay, those refused (with the reason) and the repeats
    of each letter to replay, by its ``(partition, offset)`` (pure). ``partitions``: each input
    topic's partition count, where known; a letter naming a partition its topic does not have is
    refused. (Letters replayed before are taken out first: :func:`replayed_before`.)

    A record dead-lettered more than once (it failed again after an earlier replay, or its
    producer sent it twice) is in the topic as several letters with the same source, key and
    value: it is sent once, and marked as the replay of each of them, so that the next replay
    skips them all. Otherwise every replay of a record that still fails would double its dead
    letters.
    """
    go: list[Letter] = []
    refused: list[tuple[Letter, str]] = []
    sent: dict[tuple[str, str | None, str], Letter] = {}
    repeats: dict[tuple[int, int], list[Letter]] = {}
    for letter in letters:
        dl = letter.event
        record = (dl.source_topic, dl.key_b64, dl.value_b64)
        if dl.source_topic not in inputs:
            refused.append((letter, f"{dl.source_topic} is not a stage input of this deployment"))
        elif not dl.value_b64:
            refused.append((letter, "no original value to replay"))
        elif dl.reason == "unreadable_batch":
            refused.append((letter, "a batch that could not be read, not a record: its producer must send them again"))
        elif (partitions and dl.source_partition is not None
              and dl.source_partition >= partitions.get(dl.source_topic, dl.source_partition + 1)):
            have = partitions[dl.source_topic]
            refused.append((letter, f"{dl.source_topic} has no partition {dl.source_partition} (it has {have})"))
        elif dl.truncated:
            where = f"{dl.source_topic}[{dl.source_partition}]@{dl.source_offset}"
            refused.append((letter, f"only the start of the record is quoted; the whole record is at {where}"))
        elif (first := sent.get(record)) is not None:
            repeats.setdefault((first.partition, first.offset), []).append(letter)
        else:
            sent[record] = letter
            go.append(letter)
    return go, refused, repeats


def replayed_before(cfg: KafkaSettings, letters: Iterable[Letter], inputs: frozenset[str],
                    timeout_s: float = 60.0) -> set[tuple[int, int]]:
    """``(partition, offset)`` of the letters whose record an earlier replay sent back.

    A replayed record lands in its source partition after the original, with a header naming
    its letter: each source partition is read from the oldest selected letter's record (its
    beginning, for a letter that names no offset) to its end. Letters that name no source
    partition were replayed wherever their key hashed, and are not looked for.
    """
    starts: dict[TopicPartition, int | None] = {}
    for x in letters:
        dl = x.event
        if dl.source_topic not in inputs or dl.source_partition is None:
            continue
        tp = TopicPartition(dl.source_topic, dl.source_partition)
        have = starts.get(tp, dl.source_offset)
        starts[tp] = None if have is None or dl.source_offset is None else min(have, dl.source_offset)
    found: set[tuple[int, int]] = set()
    if not starts:
        return found
    for _, rec in read_to_end(cfg, starts, client_id=f"{cfg.client_id}-deadletters",
                              timeout_s=timeout_s, max_fetch_bytes=cfg.max_request_bytes):
        for name, value in rec.headers or ():
            # (a header may have no value at all: whatever wrote it, it names no letter)
            if name == REPLAY_HEADER and value is not None and (m := _REPLAY_OF.match(value)):
                found.add((int(m[1]), int(m[2])))
    return found


def replay(cfg: KafkaSettings, topics: Topics, letters: list[Letter], dry_run: bool,
           again: bool = False) -> ReplayResult:
    """Send the letters' original records back to their source topics (see the module doc);
    with ``again``, also those an earlier replay sent."""
    inputs = frozenset({topics.generations, topics.feedback, topics.episodes, topics.rewards})
    before = 0
    if not again:
        done = replayed_before(cfg, letters, inputs)
        kept = [x for x in letters if (x.partition, x.offset) not in done]
        before, letters = len(letters) - len(kept), kept
    probe = KafkaConsumer(**kafka_python_options(cfg), client_id=f"{cfg.client_id}-deadletters")
    try:
        wanted = sorted({x.event.source_topic for x in letters} & inputs)
        partitions = {t: len(partitions_of(probe, t)) for t in wanted}
    finally:
        probe.close()
    go, refused, repeats = plan_replay(letters, inputs, partitions)
    result = ReplayResult(refused=refused, repeats=sum(map(len, repeats.values())), before=before)
    result.sent.update((x.event.source_topic, x.event.reason) for x in go)
    if dry_run:
        return result
    producer = make_producer(cfg, "replay")
    try:
        for wave in replay_waves(go, topics.feedback):
            futures = [producer.send(
                x.event.source_topic,
                key=base64.b64decode(x.event.key_b64) if x.event.key_b64 is not None else None,
                value=base64.b64decode(x.event.value_b64),
                partition=x.event.source_partition,
                headers=[(REPLAY_HEADER, f"{y.partition}:{y.offset}".encode())
                         for y in (x, *repeats.get((x.partition, x.offset), ()))],
            ) for x in wave]
            producer.flush()
            for fut in futures:
                fut.get(timeout=30)  # raises if a send failed: the operator must know
    finally:
        producer.close()
    return result


def replay_waves(go: list[Letter], feedback_topic: str) -> list[list[Letter]]:
    """The letters to replay in the order they must land (pure): feedback first, then the rest.

    A generation whose window has passed closes as soon as it arrives, folding only the feedback
    already waiting for it; replayed feedback waits afresh for its generation. So orphaned
    feedback replayed together with its dead-lettered generation joins it only if it lands
    first: the first wave is acked before the second is sent.
    """
    first = [x for x in go if x.event.source_topic == feedback_topic]
    rest = [x for x in go if x.event.source_topic != feedback_topic]
    return [wave for wave in (first, rest) if wave]


def read_letters(cfg: KafkaSettings, topic: str, timeout_s: float = 60.0) -> tuple[list[Letter], int]:
    """Every dead letter on ``topic`` up to its high watermark, and how many did not decode.

    The command's first broker call: a security setting the brokers refuse is said here, by
    name (KafkaAccessError), instead of as a read that never starts."""
    check_access(cfg, timeout_s)
    probe = KafkaConsumer(**kafka_python_options(cfg), client_id=f"{cfg.client_id}-deadletters")
    try:
        parts = partitions_of(probe, topic, timeout_s)
    finally:
        probe.close()
    letters: list[Letter] = []
    bad = 0
    for tp, rec in read_to_end(cfg, {TopicPartition(topic, p): None for p in sorted(parts)},
                               client_id=f"{cfg.client_id}-deadletters", timeout_s=timeout_s,
                               max_fetch_bytes=cfg.max_request_bytes):
        try:
            letters.append(Letter(tp.partition, rec.offset,
                                  decode(DeadLetterEvent, rec.value, max_bytes=MAX_DEADLETTER_BYTES)))
        except ContractError:
            bad += 1
    letters.sort(key=lambda x: (x.event.failed_at, x.partition, x.offset))
    return letters, bad


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z"


def run(settings: Settings, args: argparse.Namespace) -> int:
    topics = Topics(settings.topic_prefix)
    selection = selection_from_args(args, topics, time.time())
    letters, bad = read_letters(settings.kafka, topics.deadletter)
    chosen = [x for x in letters if selection.matches(x.event)]
    if args.output == "json":
        head: dict[str, Any] = {"topic": topics.deadletter, "dead_letters": len(letters), "selected": len(chosen),
                                "unreadable": bad}
        print(as_json(head | {args.action: _action_json(settings, topics, chosen, args)}))
        return 0
    print(f"{topics.deadletter}: {len(letters)} dead letters, {len(chosen)} selected"
          + (f", {bad} unreadable" if bad else ""))
    if args.action == "summary":
        print(_summary(chosen).render())
    elif args.action == "show":
        print(show(chosen, args.limit))
    else:
        print(replay(settings.kafka, topics, chosen, args.dry_run, args.again).render(args.dry_run))
    return 0


def _summary(chosen: list[Letter]) -> Summary:
    summary = Summary()
    for letter in chosen:
        summary.add(letter.event)
    return summary


def _action_json(settings: Settings, topics: Topics, chosen: list[Letter], args: argparse.Namespace) -> Any:
    if args.action == "summary":
        return _summary(chosen).to_json()
    if args.action == "show":
        return {"letters": [letter_json(x) for x in chosen[:args.limit]]}
    return replay(settings.kafka, topics, chosen, args.dry_run, args.again).to_json(args.dry_run)
