"""Parquet archive of a stage's output, partitioned by hour, written atomically.

Layout: ``<root>/hour=YYYY-MM-DDTHH/part-<epoch>-<first seq>-<last seq>.parquet`` with an explicit
pyarrow schema, readable by pandas, DuckDB, Spark or any Parquet reader, with an ``hour``
partition column. Each file is written to a temporary name in the same directory and renamed into
place: a reader (or a crash) sees a whole file or none.

Columns are only ever added (optional fields of the records), so files written before a column
existed lack it. A reader that takes its columns from the first file it opens, as
``pd.read_parquet(root)`` does, then drops the new column from every row: read with the
archive's whole schema, ``pd.read_parquet(root, schema=read_schema(EPISODE_SCHEMA))`` (or
``REWARD_SCHEMA``), and older files read as nulls in it.

The stage writes its archive queue out in batches (``archive.max_rows`` rows, or every
``archive.max_age_s``; flywheel/stream/outbox.py), so an hour holds a few large files rather than
one per loop turn. The file name carries the outbox sequence range of its rows and every row
carries its ``outbox_seq``, so a restarted stage can tell which queued rows a crashed run had
already archived. Replicas of a stage on a shared database share one root (``archive.root``, a
volume they all mount): names never collide there (the database's epoch and seqs unique across
replicas), and a replica that takes shards over sees the files their previous owner wrote.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from flywheel.durable import fsync_dir
from flywheel.stream.store import ArchiveRow

RowFn = Callable[[bytes], tuple[float, dict[str, Any]]]
TableFn = Callable[[list[bytes]], tuple[list[float], pa.Table]]
#: Rows parsed per call of a batch ``table_fn``.
TABLE_CHUNK = 4096
#: A temp file untouched for this long is a dead write's (:meth:`ParquetArchive._sweep`): a write
#: (at most about ``ARCHIVE_WRITE_BYTES`` of rows) renames its temp file seconds after creating it.
STALE_TMP_S = 600.0
_NAME = re.compile(r"part-(?P<epoch>[0-9a-f]+)-(?P<lo>\d+)-(?P<hi>\d+)\.parquet$")
log = logging.getLogger(__name__)


#: The column every archive row carries besides its record's: its outbox sequence number.
OUTBOX_SEQ = pa.field("outbox_seq", pa.int64(), nullable=False)


def read_schema(columns: pa.Schema) -> pa.Schema:
    """What a reader of an archive with record ``columns`` should ask for: those, the outbox
    sequence number and the ``hour`` partition (see the module docstring)."""
    return columns.append(OUTBOX_SEQ).append(pa.field("hour", pa.string()))


def hour_of(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H", time.gmtime(ts))


def hours_of(stamps: list[float]) -> list[str]:
    """:func:`hour_of` of each stamp, formatting each distinct hour once (a batch spans one or
    two): POSIX time has no leap seconds, so ``ts // 3600`` numbers the UTC hours."""
    names: dict[float, str] = {}
    out = []
    for ts in stamps:
        name = names.get(ts // 3600)
        if name is None:
            name = names[ts // 3600] = hour_of(ts)
        out.append(name)
    return out


class ParquetArchive:
    """Archive outbox rows: ``row_fn(value) -> (timestamp, columns)`` maps a record to a row.

    ``table_fn(values) -> (timestamps, table)`` optionally does the same for a whole batch in
    Arrow's C++ JSON reader, several times faster than building rows in Python; it must give the
    same table as ``row_fn`` (tests/unit/test_ingest_join.py and test_archive_edges.py check the
    episode one, ingest/archive.py). A chunk ``table_fn`` raises on is written by ``row_fn``, row by row.
    """

    def __init__(self, root: Path, schema: pa.Schema, row_fn: RowFn, table_fn: TableFn | None = None, *,
                 shared: bool = False) -> None:
        self.root = root
        #: Replicas on a shared database write beside each other here (:meth:`_sweep`).
        self.shared = shared
        self.columns = schema
        self.schema = schema.append(OUTBOX_SEQ)
        self.row_fn = row_fn
        self.table_fn = table_fn
        root.mkdir(parents=True, exist_ok=True)
        self._sweep(every=not shared)
        # pyarrow imports pandas the first time it converts a Python list (about a second); do it
        # at start-up rather than inside the first batch the stage processes
        pa.array([0], pa.int64())

    def write(self, epoch: str, rows: list[ArchiveRow]) -> None:
        stamps, table = self._table([row.value for row in rows])
        table = table.append_column(self.schema.field("outbox_seq"), pa.array([r.seq for r in rows], pa.int64()))
        hours = hours_of(stamps)
        for hour in dict.fromkeys(hours):
            idx = [i for i, h in enumerate(hours) if h == hour]
            # filter, not take: take joins each column's chunks into one array first, which fails
            # once a string column passes 2 GiB (long prompts, a full queue), every restart alike
            part = table if len(idx) == len(rows) else table.filter(pa.array([h == hour for h in hours]))
            seqs = [rows[i].seq for i in idx]
            folder = self.root / f"hour={hour}"
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                fsync_dir(self.root)  # the new hour's own name
            final = folder / f"part-{epoch}-{min(seqs):012d}-{max(seqs):012d}.parquet"
            tmp = folder / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                pq.write_table(part, tmp, compression="zstd")
                with open(tmp, "rb") as fh:  # the bytes must be on disk before the name is
                    os.fsync(fh.fileno())
                os.replace(tmp, final)
            except BaseException:
                # a full disk fails every retry alike: each must not leave what it wrote behind
                tmp.unlink(missing_ok=True)
                raise
            # and the name before the caller drops the rows from its queue: after a node loss an
            # un-fsynced rename may be undone, and the rows would be in neither place
            fsync_dir(folder)

    def _table(self, values: list[bytes]) -> tuple[list[float], pa.Table]:
        # the batch reader takes one record per line: a value spanning lines takes the row path
        if self.table_fn is None or any(b"\n" in v for v in values):
            return self._rows(values)
        # a few thousand rows per parse: one parse of 20,000 rows cost three times as much per
        # row (it no longer fits the CPU caches), and the tables concatenate for free
        parts = [self._chunk(values[i:i + TABLE_CHUNK]) for i in range(0, len(values), TABLE_CHUNK)]
        if len(parts) == 1:
            return parts[0]
        return [ts for stamps, _ in parts for ts in stamps], pa.concat_tables([t for _, t in parts])

    def _chunk(self, values: list[bytes]) -> tuple[list[float], pa.Table]:
        """One chunk by ``table_fn``, or by ``row_fn`` where ``table_fn`` refuses it."""
        assert self.table_fn is not None
        try:
            return self.table_fn(values)
        except Exception:  # (ArrowInvalid, msgspec's errors...: whatever the fast path raises)
            # The batch reader is stricter than the row path, the reference: it refuses values an
            # older version stored and the row path takes (1.0 in an int column). Raised, the
            # archive write would fail on the same queue at every retry, for good; a chunk the
            # row path refuses too raises the row path's error.
            log.warning("archive %s: the batch parse refused %d rows; writing them row by row",
                        self.root.name, len(values), exc_info=True)
            return self._rows(values)

    def _rows(self, values: list[bytes]) -> tuple[list[float], pa.Table]:
        stamps, items = [], []
        for value in values:
            ts, cols = self.row_fn(value)
            stamps.append(ts)
            items.append(cols)
        return stamps, pa.Table.from_pylist(items, schema=self.columns)

    def _sweep(self, every: bool = False) -> None:
        """Delete the temp files of writes that died: those untouched for ``STALE_TMP_S``, or
        ``every`` one at the start of a process whose root is its own (its data_dir is locked, so
        no write is in progress; a crash loop faster than ``STALE_TMP_S`` would otherwise keep a
        temp file of up to ``ARCHIVE_WRITE_BYTES`` from each crash).

        A kill -9 in the middle of a write leaves its temp file. The replicas of a stage on a shared
        database share one root, so another live process may be writing the temp file next to
        this one's: only age tells a dead write from a live one across machines (a per-process
        token would still need the liveness of its process). A live write renames its temp file
        seconds after creating it; and deleting one whose writer is only paused (SIGSTOPped) loses
        nothing: its rename fails, its transaction rolls back, and its rows stay queued.
        """
        old = math.inf if every else time.time() - STALE_TMP_S
        for partial in self.root.glob("hour=*/.part-*.tmp"):
            try:
                if partial.stat().st_mtime < old:
                    partial.unlink()
            except FileNotFoundError:
                pass  # renamed or swept by its writer, or by another replica's sweep

    def archived_seqs(self, epoch: str, lo: int, hi: int) -> set[int]:
        """Outbox sequence numbers in ``[lo, hi]`` that some archive file of ``epoch`` holds.

        Files are picked by their names (epoch, first and last seq); only those whose seq range
        meets ``[lo, hi]`` are opened, for their ``outbox_seq`` column. It also sweeps dead writes'
        temp files (:meth:`_sweep`): it runs at a stage's start and whenever a replica on a shared
        root takes shards over, often enough that a killed replica's leftovers do not pile up.
        """
        self._sweep()
        found: set[int] = set()
        for path in self.root.glob("hour=*/part-*.parquet"):
            m = _NAME.search(path.name)
            if not m or m["epoch"] != epoch or int(m["hi"]) < lo or int(m["lo"]) > hi:
                continue
            col = pq.read_table(path, columns=["outbox_seq"]).column("outbox_seq").to_pylist()
            found.update(s for s in col if lo <= s <= hi)
        return found

    def files(self) -> list[Path]:
        return sorted(self.root.glob("hour=*/part-*.parquet"))
