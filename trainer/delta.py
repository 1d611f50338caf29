"""Lossless weight deltas between consecutive published versions (bit-exact, numpy + zstd).

An RL step moves few weights *in the served precision*: at small learning rates most bf16 values
of version v are bit-identical to version v-1, and the ones that moved usually moved by one or two
units in the last place. The codec exploits both facts instead of compressing a dense XOR:

1. View the safetensors data section as unsigned integers of the element width (2 bytes for
   bf16/fp16, 4 for fp32) and take the *modular difference* ``child - parent`` of the bit
   patterns. For floats of one sign the bit pattern is monotonic in the value, so a one-ulp step
   is a difference of +-1, where an XOR of the same pair can flip a whole run of low bits.
2. Code *where* values changed as gaps between changed positions (a geometric-like run length,
   which compresses far better than a sparse bitmap or a dense XOR full of zero words).
3. Code *what* changed as zig-zag integers (small magnitudes -> small codes) split into byte
   planes: the low plane carries almost all the information, the high planes are nearly all zero
   and zstd shrinks them to almost nothing.

Decoding is vectorised (cumulative sum of gaps, one scatter-add), so applying a delta costs less
than reading the full weights. :func:`naive_xor` is the dense XOR + zstd baseline the benchmark
(bench/delta_compression.py) compares against. The container also carries the child's safetensors
header, so reconstruction reproduces the child *file* byte for byte and its manifest hash holds.
"""

from __future__ import annotations

import hashlib
import json
import struct
from math import gcd

import numpy as np
import zstandard

MAGIC = b"FWDELTA1"
CODEC = "gap-zigzag-planes/zstd"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class DeltaError(ValueError):
    """A delta that cannot be applied to the given parent (wrong parent, corrupt container)."""


def split_safetensors(raw: bytes) -> tuple[bytes, bytes, dict]:
    """``(prefix, data, header)``: prefix is the 8-byte length plus the JSON header."""
    if len(raw) < 8:
        raise DeltaError("not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return raw[: 8 + n], raw[8 + n :], header


def element_width(header: dict) -> int:
    """The widest integer view every tensor's bytes divide into (gcd of the element sizes)."""
    width = 0
    for name, meta in header.items():
        if name != "__metadata__":
            width = gcd(width, _ITEMSIZE.get(meta["dtype"], 1))
    return width or 1


def _planes(a: np.ndarray) -> list[bytes]:
    """Byte planes of an unsigned array: plane k holds byte k of every element."""
    b = a.view(np.uint8).reshape(-1, a.itemsize)
    return [np.ascontiguousarray(b[:, k]).tobytes() for k in range(a.itemsize)]


def _unplanes(planes: list[bytes], dtype: type, n: int) -> np.ndarray:
    b = np.empty((n, len(planes)), dtype=np.uint8)
    for k, p in enumerate(planes):
        b[:, k] = np.frombuffer(p, dtype=np.uint8)
    return b.reshape(-1).view(dtype)


def encode_data(parent: bytes, child: bytes, width: int, level: int = 3) -> tuple[dict, list[bytes]]:
    """Delta of two equally long data sections; returns (header fields, compressed blobs)."""
    if len(parent) != len(child) or len(parent) % width:
        raise DeltaError(f"data sections differ in size ({len(parent)} vs {len(child)} bytes)")
    u, s = _UINT[width], _INT[width]
    a = np.frombuffer(parent, dtype=u)
    diff = np.frombuffer(child, dtype=u) - a  # modular: wraps, so it is always invertible
    idx = np.flatnonzero(diff)
    gaps = np.diff(idx, prepend=-1).astype(np.uint64) - 1
    gaps = gaps.astype(np.uint32) if len(a) < 2**32 else gaps
    signed = diff[idx].view(s)
    zig = ((signed.astype(np.int64) << 1) ^ (signed.astype(np.int64) >> 63)).astype(u)
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    blobs = [cctx.compress(p) for p in _planes(gaps) + _planes(zig)]
    meta = {"width": width, "elements": len(a), "changed": len(idx), "gap_width": gaps.itemsize}
    return meta, blobs


def decode_data(parent: bytes, meta: dict, blobs: list[bytes]) -> bytes:
    width, n, changed, gw = meta["width"], meta["elements"], meta["changed"], meta["gap_width"]
    if len(parent) != n * width:
        raise DeltaError(f"parent data is {len(parent)} bytes, delta expects {n * width}")
    if len(blobs) != gw + width:
        raise DeltaError("delta has the wrong number of planes")
    dctx = zstandard.ZstdDecompressor()
    raw = [dctx.decompress(b, max_output_size=changed) if changed else b"" for b in blobs]
    if any(len(r) != changed for r in raw):
        raise DeltaError("delta plane has the wrong length (corrupt container)")
    gaps = _unplanes(raw[:gw], _UINT[gw], changed).astype(np.int64)
    idx = np.cumsum(gaps + 1) - 1
    if changed and (idx[-1] >= n):
        raise DeltaError("delta position beyond the end of the parent (corrupt container)")
    zig = _unplanes(raw[gw:], _UINT[width], changed).astype(np.int64) & ((1 << (8 * width)) - 1)
    signed = (zig >> 1) ^ -(zig & 1)
    out = np.frombuffer(parent, dtype=_UINT[width]).copy()
    out[idx] += signed.astype(_INT[width]).view(_UINT[width])
    return out.tobytes()


def make_delta(parent_file: bytes, child_file: bytes, *, parent_version: int, level: int = 3) -> bytes:
    """Container turning ``parent_file`` (safetensors bytes) into ``child_file`` exactly."""
    p_prefix, p_data, p_header = split_safetensors(parent_file)
    c_prefix, c_data, c_header = split_safetensors(child_file)
    if _layout(p_header) != _layout(c_header):
        raise DeltaError("parent and child tensors differ in names, dtypes or shapes; publish a full snapshot")
    meta, blobs = encode_data(p_data, c_data, element_width(c_header), level)
    prefix_blob = zstandard.ZstdCompressor(level=level).compress(c_prefix)
    header = {
        "codec": CODEC,
        "parent_version": parent_version,
        "parent_sha256": hashlib.sha256(parent_file).hexdigest(),
        "child_bytes": len(child_file),
        **meta,
        "blobs": [len(prefix_blob), *map(len, blobs)],
    }
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, prefix_blob, *blobs])


def read_header(delta: bytes) -> dict:
    if delta[:8] != MAGIC:
        raise DeltaError("not a Flywheel delta (bad magic)")
    (n,) = struct.unpack("<Q", delta[8:16])
    try:
        return json.loads(delta[16 : 16 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaError(f"delta header is not JSON: {exc}") from None


def apply_delta(parent_file: bytes, delta: bytes) -> bytes:
    """The child's safetensors bytes; raises :class:`DeltaError` if ``parent_file`` is not the parent."""
    header = read_header(delta)
    if hashlib.sha256(parent_file).hexdigest() != header["parent_sha256"]:
        raise DeltaError(f"parent bytes do not match the delta's parent (version {header['parent_version']})")
    pos = 16 + len(json.dumps(header, sort_keys=True).encode())
    blobs = []
    for size in header["blobs"]:
        blobs.append(delta[pos : pos + size])
        pos += size
    try:
        prefix = zstandard.ZstdDecompressor().decompress(blobs[0])
        _, p_data, _ = split_safetensors(parent_file)
        data = decode_data(p_data, header, blobs[1:])
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    out = prefix + data
    if len(out) != header["child_bytes"]:
        raise DeltaError("reconstructed file has the wrong size")
    return out


def _layout(header: dict) -> list[tuple]:
    return sorted(
        (k, v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in header.items() if k != "__metadata__"
    )


def naive_xor(parent: bytes, child: bytes, level: int = 3) -> bytes:
    """Baseline: dense XOR of the raw bits, zstd-compressed (what the codec above improves on)."""
    a = np.frombuffer(parent, dtype=np.uint8)
    b = np.frombuffer(child, dtype=np.uint8)
    return zstandard.ZstdCompressor(level=level).compress((a ^ b).tobytes())


def naive_xor_apply(parent: bytes, blob: bytes) -> bytes:
    x = zstandard.ZstdDecompressor().decompress(blob, max_output_size=len(parent))
    return (np.frombuffer(parent, dtype=np.uint8) ^ np.frombuffer(x, dtype=np.uint8)).tobytes()
