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
A delta is between two single files: the store keeps every version's weights as one
``model.safetensors``, also for a model imported in shards (flywheel/checkpoints/store.py says why),
or, for a LoRA version, one ``adapter_model.safetensors``: the codec reads any safetensors file,
and two adapters of one rank and target modules share a layout as two full versions do. An
adapter moves most of its values every step (no frozen bulk), so its delta is smaller mostly
because the adapter is.
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


def _zigzag(diff: np.ndarray, width: int) -> np.ndarray:
    wide = np.int32 if width <= 2 else np.int64
    signed = diff.view(_INT[width]).astype(wide)
    return ((signed << 1) ^ (signed >> (8 * np.dtype(wide).itemsize - 1))).astype(_UINT[width])


def _unzigzag(zig: np.ndarray, width: int) -> np.ndarray:
    wide = np.int32 if width <= 2 else np.int64
    z = zig.astype(wide) & ((1 << (8 * width)) - 1) if width < 8 else zig.view(np.int64)
    return ((z >> 1) ^ -(z & 1)).astype(_INT[width]).view(_UINT[width])


def encode_data(parent: bytes, child: bytes, width: int, level: int = 3) -> tuple[dict, list[bytes]]:
    """Delta of two equally long data sections; returns (header fields, compressed blobs).

    ``sparse`` codes the gaps between changed positions plus the changed values; ``dense`` codes
    every element's zig-zag difference (zeros included). Sparse wins when few values moved;
    above a few percent both are tried and the smaller kept (dense also applies faster then).
    """
    if len(parent) != len(child) or len(parent) % width:
        raise DeltaError(f"data sections differ in size ({len(parent)} vs {len(child)} bytes)")
    a = np.frombuffer(parent, dtype=_UINT[width])
    diff = np.frombuffer(child, dtype=_UINT[width]) - a  # modular: wraps, so it is always invertible
    idx = np.flatnonzero(diff)
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint32 if len(a) < 2**32 else np.uint64)
    sparse = [cctx.compress(p) for p in _planes(gaps) + _planes(_zigzag(diff[idx], width))]
    meta = {"width": width, "elements": len(a), "changed": len(idx), "gap_width": gaps.itemsize, "mode": "sparse"}
    if len(idx) > len(a) // 20:
        dense = [cctx.compress(p) for p in _planes(_zigzag(diff, width))]
        if sum(map(len, dense)) < sum(map(len, sparse)):
            return {**meta, "mode": "dense", "gap_width": 0}, dense
    return meta, sparse


def decode_data(parent: bytes, meta: dict, blobs: list[bytes], out: np.ndarray | None = None) -> np.ndarray:
    """The child's data section as a uint array (written into ``out`` when given)."""
    width, n, changed, gw = meta["width"], meta["elements"], meta["changed"], meta["gap_width"]
    if len(parent) != n * width:
        raise DeltaError(f"parent data is {len(parent)} bytes, delta expects {n * width}")
    if len(blobs) != gw + width:
        raise DeltaError("delta has the wrong number of planes")
    count = n if meta.get("mode") == "dense" else changed
    dctx = zstandard.ZstdDecompressor()
    raw = [dctx.decompress(b, max_output_size=count) if count else b"" for b in blobs]
    if any(len(r) != count for r in raw):
        raise DeltaError("delta plane has the wrong length (corrupt container)")
    u = _UINT[width]
    if out is None:
        out = np.empty(n, dtype=u)
    if not np.shares_memory(out, np.frombuffer(parent, dtype=np.uint8)):
        np.copyto(out, np.frombuffer(parent, dtype=u))
    values = _unzigzag(_unplanes(raw[gw:], u, count), width)
    if meta.get("mode") == "dense":
        out += values
        return out
    idx = np.cumsum(_unplanes(raw[:gw], _UINT[gw], count).astype(np.int64) + 1) - 1
    if changed and idx[-1] >= n:
        raise DeltaError("delta position beyond the end of the parent (corrupt container)")
    out[idx] += values
    return out


def make_delta(parent_file: bytes, child_file: bytes, *, parent_version: int, level: int = 3) -> bytes:
    """Container turning ``parent_file`` (safetensors bytes) into ``child_file`` exactly."""
    _, p_data, p_header = split_safetensors(parent_file)
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


def apply_delta_inplace(parent_file: bytearray, delta: bytes) -> bytearray:
    """Turn a verified parent (a writable buffer, e.g. a host copy serving keeps) into the child
    in place: no full-size copy, only the changed values are touched."""
    header = read_header(delta)
    pos = 16 + len(json.dumps(header, sort_keys=True).encode())
    sizes = header["blobs"]
    blobs = [delta[pos + sum(sizes[:i]) : pos + sum(sizes[: i + 1])] for i in range(len(sizes))]
    try:
        prefix = zstandard.ZstdDecompressor().decompress(blobs[0])
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    (n,) = struct.unpack("<Q", bytes(parent_file[:8]))
    if 8 + n != len(prefix) or len(parent_file) != header["child_bytes"]:
        raise DeltaError("in-place apply needs the parent and child to share their layout")
    parent_file[: len(prefix)] = prefix
    view = np.frombuffer(parent_file, dtype=_UINT[header["width"]], offset=len(prefix))
    try:
        decode_data(memoryview(parent_file)[len(prefix):], header, blobs[1:], out=view)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    return parent_file


def apply_delta(parent_file: bytes, delta: bytes, *, check_parent: bool = True) -> bytes:
    """The child's safetensors bytes; raises :class:`DeltaError` if ``parent_file`` is not the parent.

    ``check_parent=False`` skips hashing the parent when the caller has already verified it
    against a manifest (the checkpoint store does), which is most of the cost of an apply.
    """
    header = read_header(delta)
    if check_parent and hashlib.sha256(parent_file).hexdigest() != header["parent_sha256"]:
        raise DeltaError(f"parent bytes do not match the delta's parent (version {header['parent_version']})")
    pos = 16 + len(json.dumps(header, sort_keys=True).encode())
    blobs = []
    for size in header["blobs"]:
        blobs.append(delta[pos : pos + size])
        pos += size
    try:
        prefix = zstandard.ZstdDecompressor().decompress(blobs[0])
        _, p_data, _ = split_safetensors(parent_file)
        buf = bytearray(header["child_bytes"])
        if len(prefix) + len(p_data) != len(buf):
            raise DeltaError("reconstructed file has the wrong size")
        buf[: len(prefix)] = prefix
        view = np.frombuffer(buf, dtype=_UINT[header["width"]], offset=len(prefix))
        decode_data(p_data, header, blobs[1:], out=view)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    return bytes(buf)


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
