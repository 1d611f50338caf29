"""Process-group setup for the trainer: the same code runs alone, under torchrun or under the
``deepspeed`` launcher, on CPUs (gloo) or GPUs (NCCL).

DeepSpeed reads ``RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT`` and falls back to MPI
discovery (which fails here) when any is missing, so a single process gets the single-process
values. This is entrypoint code: it is the one place the trainer touches ``os.environ``.
"""

from __future__ import annotations

import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env(env: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """Fill in a world of one where no launcher set the variables."""
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    if "DS_ACCELERATOR" not in env:
        import torch

        env["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


def init() -> tuple[int, int]:
    """Initialise DeepSpeed's process group once; returns ``(rank, world_size)``."""
    single_process_env()
    import deepspeed
    import deepspeed.comm as dist

    # The shared-memory collective op is JIT-compiled on first use (~30 s on a CPU); gloo
    # is fast enough for the trainer's all-reduces, so skip the build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=None)
    return dist.get_rank(), dist.get_world_size()


def broadcast(obj: object, rank: int, world: int) -> object:
    """Rank 0's ``obj`` on every rank (a no-op in a world of one)."""
    if world == 1:
        return obj
    import torch.distributed as tdist

    box = [obj if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any (just ``flag`` in a world of one)."""
    import torch
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_initialized() or tdist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else None
    box = torch.tensor([float(flag)], device=device)
    tdist.all_reduce(box, op=tdist.ReduceOp.MAX)
    return bool(box.item())


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as tdist

        tdist.barrier()


def shutdown() -> None:
    """Tear the process group down before the interpreter exits.

    Left to interpreter teardown, gloo's worker threads can be destroyed while still joinable,
    and the C++ runtime aborts the process ("terminate called without an active exception"):
    torchrun then reports a clean stop as a failure.
    """
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def cpu_threads(n: int) -> None:
    """Set torch's intra-op threads on the CPU backend (0: leave torch's default)."""
    import torch

    if n > 0 and not torch.cuda.is_available():
        torch.set_num_threads(n)
