"""The delta codec is lossless bit for bit, smaller than the naive XOR, and refuses wrong input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save

from flywheel.checkpoints import delta as D


def _pair(dtype, frac, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"a.weight": torch.randn(256, 128, generator=g), "b.bias": torch.randn(128, generator=g)}
    child = {}
    for k, v in w.items():
        moved = torch.rand(v.shape, generator=g) < frac
        child[k] = torch.where(moved, v + 0.05 * v.abs() * torch.randn(v.shape, generator=g), v)
    return save({k: v.to(dtype) for k, v in w.items()}), save({k: v.to(dtype) for k, v in child.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("frac", [0.0, 0.03, 0.5, 1.0])
def test_roundtrip_is_bit_exact(dtype, frac):
    parent, child = _pair(dtype, frac)
    blob = D.make_delta(parent, child, parent_version=7)
    assert D.apply_delta(parent, blob) == child
    assert D.read_header(blob)["parent_version"] == 7


def test_sparse_changes_beat_the_naive_xor():
    parent, child = _pair(torch.bfloat16, 0.03)
    ours = len(D.make_delta(parent, child, parent_version=0))
    naive = len(D.naive_xor(parent, child))
    assert ours < naive
    assert D.naive_xor_apply(parent, D.naive_xor(parent, child)) == child


def test_sign_crossings_and_extremes_survive():
    a = np.array([0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x0001], dtype=np.uint16).tobytes()
    b = np.array([0x8000, 0x0000, 0xFF7F, 0x7F7F, 0xFFFF], dtype=np.uint16).tobytes()
    meta, blobs = D.encode_data(a, b, 2)
    assert D.decode_data(a, meta, blobs).tobytes() == b


def test_wrong_parent_and_corruption_are_refused():
    parent, child = _pair(torch.bfloat16, 0.1)
    blob = D.make_delta(parent, child, parent_version=1)
    with pytest.raises(D.DeltaError, match="parent"):
        D.apply_delta(child, blob)
    bad = bytearray(blob)
    bad[-3] ^= 0xFF
    with pytest.raises(D.DeltaError):
        D.apply_delta(parent, bytes(bad))
    with pytest.raises(D.DeltaError, match="magic"):
        D.apply_delta(parent, b"XXXXXXXX" + blob[8:])


def test_dense_mode_is_chosen_when_most_values_move():
    parent, child = _pair(torch.bfloat16, 1.0)
    blob = D.make_delta(parent, child, parent_version=0)
    assert D.read_header(blob)["mode"] == "dense"
    assert D.apply_delta(parent, blob) == child
    parent, child = _pair(torch.bfloat16, 0.01)
    assert D.read_header(D.make_delta(parent, child, parent_version=0))["mode"] == "sparse"
