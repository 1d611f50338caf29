"""The vLLM worker set-up: which CPUs need the AMX request, and that the request is granted.

The end-to-end proof is tests/integration/test_serving_api.py, whose engine died of SIGILL on
its first tempered request on an AMX machine before the worker asked for AMX.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.vllm_worker import cpu_has_amx, request_amx


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
