"""Rows the trainer builds from reward records: masks line up with the completion, and a batch moves
whole to the device that trains (a GPU): a tensor left behind on the CPU fails the first forward."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from trainer_helpers import reward_event

from trainer.policy import Batch, collate


def test_collate_masks_exactly_the_completion_tokens_and_pads_to_the_longest_row():
    short = reward_event(0, completion=(10, 11), logprobs=(-1.0, -2.0))
    long = reward_event(1, completion=(20, 21, 22, 23), logprobs=(-0.5, -0.25, -0.125, -4.0))
    b = collate([short, long], pad_id=0)
    assert b.input_ids.shape == (2, 3 + 4)
    # logits at position p-1 predict the first completion token (prompts are 3 tokens long)
    assert b.mask[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert b.mask[1].tolist() == [0, 0, 1, 1, 1, 1]
    assert b.targets[1, 2:].tolist() == [20, 21, 22, 23]
    assert b.old_logp[1, 2:].tolist() == [-0.5, -0.25, -0.125, -4.0]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]


def test_a_batch_moves_every_tensor_to_the_training_device_and_keeps_its_groups():
    b = collate([reward_event(i, group=f"g{i % 2}") for i in range(3)], pad_id=0)
    moved = b.to(torch.device("meta"))
    tensors = [f.name for f in dataclasses.fields(Batch) if isinstance(getattr(b, f.name), torch.Tensor)]
    assert len(tensors) == 8
    assert [n for n in tensors if getattr(moved, n).device.type != "meta"] == []
    assert [n for n in tensors if getattr(moved, n).shape != getattr(b, n).shape] == []
    assert moved.group_ids == ["g0", "g1", "g0"]


def test_published_weights_hold_a_tied_tensor_once_and_save_as_safetensors(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from trainer.policy import without_aliases

    emb = torch.nn.Parameter(torch.randn(8, 4))
    other = torch.randn(4)
    state = {"model.embed_tokens.weight": emb, "model.norm.weight": other, "lm_head.weight": emb,
             "view.of.other": other[:2]}  # a view of another tensor's start is another tensor
    kept = without_aliases(state)
    assert list(kept) == ["model.embed_tokens.weight", "model.norm.weight", "view.of.other"]
    save_file({k: v.detach().clone().contiguous() for k, v in kept.items()}, str(tmp_path / "m.safetensors"))
    assert set(load_file(str(tmp_path / "m.safetensors"))) == set(kept)
