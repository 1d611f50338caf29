"""A bounded, fsync'd, append-only local journal for events the broker has not acknowledged.

Serving writes here when Kafka is unreachable or slow (see :mod:`serving.recorder`) and replays
from here, in order, when the broker is back. It is the reason a 202 for feedback can be given
during a broker outage: the event is on local disk first.

Layout under the journal directory::

    journal.log    frames, appended and fsync'd before an append returns
    journal.head   decimal byte offset of the first frame not yet delivered (atomically replaced)

Frame format (little-endian)::

    u32 payload_length | u32 crc32(payload) | payload
    payload = u16 topic_len | topic utf-8 | i32 key_len (-1: no key) | key | [headers] | value bytes
    headers = u16 count | (u16 name_len | name utf-8 | u32 value_len | value)*

``headers`` (the record's Kafka headers: its request id and trace context, flywheel/telemetry.py)
is there when the top bit of ``topic_len`` is set, so frames written before headers existed
read as they always did. A topic name is at most 249 characters: the bit is never a length's.

A crash can leave a torn tail (a frame half written, or written but not fsync'd): on open, frames
are scanned from the head and the first one whose length runs past the end of the file or whose
crc does not match ends the journal; the file is truncated there. Frames before it were fsync'd
when their append returned, so nothing acknowledged to a client is cut.

Where a restart resumes: at ``journal.head``. The head is advanced only after the broker acked
every frame before the new offset, so a crash between the ack and the head update replays those
frames again: delivery from the journal is at-least-once, and downstream stages dedupe by
``feedback_id`` / ``generation_id``. When every frame is delivered the journal is compacted to
empty (both files reset), so the bound (``max_bytes``, on the log file's size) applies to what is
pending plus at most one delivered-but-not-yet-compacted run.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

_FRAME = struct.Struct("<II")
_HAS_HEADERS = 0x8000  # in topic_len: the frame holds headers

#: Kafka headers as kafka-python takes them.
Headers = list[tuple[str, bytes]]


class JournalFull(RuntimeError):
    """The journal reached its byte bound; the caller must refuse the event, not drop it."""


@dataclass(frozen=True)
class Entry:
    topic: str
    key: str | None
    value: bytes
    #: Offset just past this frame: where the head moves once the entry is delivered.
    end: int
    headers: Headers | None = None


def _payload(topic: str, key: str | None, value: bytes, headers: Headers | None = None) -> bytes:
    t = topic.encode("utf-8")
    k = key.encode("utf-8") if key is not None else b""
    klen = len(k) if key is not None else -1
    flag, h = 0, b""
    if headers:
        flag = _HAS_HEADERS
        h = struct.pack("<H", len(headers)) + b"".join(
            struct.pack("<H", len(n := name.encode("utf-8"))) + n + struct.pack("<I", len(v)) + v
            for name, v in headers)
    return struct.pack("<H", len(t) | flag) + t + struct.pack("<i", klen) + k + h + value


def _unpack(payload: bytes) -> tuple[str, str | None, bytes, Headers | None]:
    (tlen,) = struct.unpack_from("<H", payload, 0)
    flag, tlen = tlen & _HAS_HEADERS, tlen & ~_HAS_HEADERS
    topic = payload[2 : 2 + tlen].decode("utf-8")
    (klen,) = struct.unpack_from("<i", payload, 2 + tlen)
    pos = 6 + tlen
    key = None if klen < 0 else payload[pos : pos + klen].decode("utf-8")
    pos += max(klen, 0)
    headers: Headers | None = None
    if flag:
        (count,) = struct.unpack_from("<H", payload, pos)
        pos += 2
        headers = []
        for _ in range(count):
            (nlen,) = struct.unpack_from("<H", payload, pos)
            name = payload[pos + 2 : pos + 2 + nlen].decode("utf-8")
            (vlen,) = struct.unpack_from("<I", payload, pos + 2 + nlen)
            pos += 6 + nlen
            headers.append((name, payload[pos : pos + vlen]))
            pos += vlen
    return topic, key, payload[pos:], headers


class Journal:
    """Thread-safe: one thread appends while another reads and advances the head."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._log_path = self.dir / "journal.log"
        self._head_path = self.dir / "journal.head"
        self._lock = threading.Lock()
        self._head = self._read_head()
        self._f = open(self._log_path, "a+b")  # noqa: SIM115 - held open for the journal's life
        #: Records found torn at open (for the log and a test).
        self.truncated_bytes = 0
        self._size, self._records = self._recover()

    # -- open / recovery ---------------------------------------------------------------------
    def _read_head(self) -> int:
        try:
            return int(self._head_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _recover(self) -> tuple[int, int]:
        """Scan from the head; truncate at the first torn or corrupt frame."""
        size = os.fstat(self._f.fileno()).st_size
        if self._head > size:  # head written, log lost: nothing pending is knowable
            self._head = 0
            self._write_head(0)
        pos, count = self._head, 0
        while pos < size:
            frame = self._read_frame(pos, size)
            if frame is None:
                break
            pos, count = frame[1], count + 1
        if pos < size:
            self.truncated_bytes = size - pos
            self._f.truncate(pos)
            os.fsync(self._f.fileno())
        return pos, count

    def _read_frame(self, pos: int, size: int) -> tuple[bytes, int] | None:
        if pos + _FRAME.size > size:
            return None
        self._f.seek(pos)
        length, crc = _FRAME.unpack(self._f.read(_FRAME.size))
        end = pos + _FRAME.size + length
        if end > size:
            return None
        payload = self._f.read(length)
        if zlib.crc32(payload) != crc:
            return None
        return payload, end

    # -- writing -----------------------------------------------------------------------------
    def append(self, items: list[tuple[str, str | None, bytes]] | list[tuple[str, str | None, bytes, Headers | None]]
               ) -> None:
        """Append frames (topic, key, value and optionally headers) and fsync once; all or nothing
        against the bound."""
        if not items:
            return
        blob = b"".join(
            _FRAME.pack(len(p), zlib.crc32(p)) + p for p in (_payload(*it) for it in items)
        )
        with self._lock:
            if self._size + len(blob) > self.max_bytes:
                raise JournalFull(
                    f"local journal is full ({self._size} of {self.max_bytes} bytes pending)"
                )
            self._f.seek(0, os.SEEK_END)
            self._f.write(blob)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._size += len(blob)
            self._records += len(items)

    # -- reading / delivery ------------------------------------------------------------------
    def peek(self, limit: int) -> list[Entry]:
        """Up to ``limit`` undelivered entries, oldest first (the head does not move)."""
        out: list[Entry] = []
        with self._lock:
            pos = self._head
            while pos < self._size and len(out) < limit:
                frame = self._read_frame(pos, self._size)
                if frame is None:  # cannot happen after recovery; stop rather than loop
                    break
                topic, key, value, headers = _unpack(frame[0])
                pos = frame[1]
                out.append(Entry(topic, key, value, pos, headers))
        return out

    def advance(self, entries: list[Entry]) -> None:
        """Mark ``entries`` (a prefix returned by :meth:`peek`) delivered; compact when empty."""
        if not entries:
            return
        with self._lock:
            self._head = entries[-1].end
            self._records -= len(entries)
            if self._head >= self._size:
                self._f.truncate(0)
                os.fsync(self._f.fileno())
                self._head = self._size = self._records = 0
            self._write_head(self._head)

    def _write_head(self, offset: int) -> None:
        tmp = self._head_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(str(offset))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self._head_path)

    # -- state -------------------------------------------------------------------------------
    @property
    def records(self) -> int:
        """Undelivered records."""
        return self._records

    @property
    def pending_bytes(self) -> int:
        return self._size - self._head

    @property
    def size_bytes(self) -> int:
        """Bytes counted against the bound."""
        return self._size

    def empty(self) -> bool:
        with self._lock:
            return self._records == 0

    def close(self) -> None:
        with self._lock:
            self._f.close()
