"""The vLLM worker set-up: which CPUs need the AMX request, and that the request is granted; a
tied output head tied again after a weight swap (the swap of a real engine: tests/integration/
test_own_model.py, slow).

The end-to-end proof is tests/integration/test_serving_api.py, whose engine died of SIGILL on
its first tempered request on an AMX machine before the worker asked for AMX.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving.vllm_worker import cpu_has_amx, request_amx, retie, tie_groups


@pytest.mark.parametrize("cpuinfo, amx", [
    ("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8\n", True),
    ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n", False),
    ("flags\t\t: fpu amx_tiles_future\n", False),  # a flag that only starts with the name
    ("", False),
])
def test_cpu_has_amx(cpuinfo, amx):
    assert cpu_has_amx(cpuinfo) is amx


def test_request_amx_is_granted_where_the_cpu_has_it():
    info = Path("/proc/cpuinfo")
    has = info.exists() and cpu_has_amx(info.read_text())
    assert request_amx() is has
    assert request_amx() is has  # asking again is harmless


class _Packs:
    """A quant method that builds a kernel from the weight once, as vLLM's CPU GEMM packs the head."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.calls += 1
        layer.packed = layer.weight.detach().clone()


class _Tied(torch.nn.Module):
    """An embedding and an output head sharing one parameter, as a tied language model holds them
    (registered in that order, as vLLM's models are: the embeddings own the tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 3)
        self.head = torch.nn.Linear(3, 6, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(3)
        for module in (self.embed, self.head):
            module.quant_method = _Packs()
            module.quant_method.process_weights_after_loading(module)


def test_retie_points_a_head_the_reload_left_behind_at_the_reloaded_embeddings():
    model = _Tied()
    groups = tie_groups(model)
    assert [names for names, _ in groups] == [["embed.weight", "head.weight"]]
    new = torch.randn(6, 3)
    old = model.embed.weight
    model.embed.weight = torch.nn.Parameter(new.clone())  # loaded into a new parameter,
    model.head.weight = old                               # the alias given its old one back
    assert retie(model, groups) == ["head.weight"]
    assert model.head.weight is model.embed.weight and torch.equal(model.head.packed, new)


def test_retie_rebuilds_the_heads_kernel_when_the_reload_kept_the_tie():
    model = _Tied()
    groups = tie_groups(model)
    new = torch.randn(6, 3)
    with torch.no_grad():
        model.embed.weight.copy_(new)  # loaded in place: still one parameter
    model.embed.quant_method.process_weights_after_loading(model.embed)  # the reload rebuilds what it loaded
    assert not torch.equal(model.head.packed, new)  # the swap's bug: predicting with the old head
    assert retie(model, groups) == ["head.weight"]
    assert torch.equal(model.head.packed, new) and model.head.weight is model.embed.weight
    assert model.embed.quant_method.calls == 2  # the owner is not rebuilt a second time


def test_retie_leaves_alone_names_each_loaded_on_their_own():
    model = _Tied()
    groups = tie_groups(model)
    model.embed.weight = torch.nn.Parameter(torch.randn(6, 3))
    model.head.weight = torch.nn.Parameter(torch.randn(6, 3))  # a checkpoint that names both
    assert retie(model, groups) == [] and model.head.weight is not model.embed.weight
    assert model.head.quant_method.calls == 1
