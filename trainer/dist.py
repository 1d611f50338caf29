"""Process-group setup for the trainer: the same code runs alone, under torchrun or under the
``deepspeed`` launcher, on CPUs (gloo) or GPUs (NCCL).

DeepSpeed reads ``RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT`` and falls back to MPI
discovery (which fails here) when any is missing, so a single process gets the single-process
values. This is entrypoint code: it is the one place the trainer touches ``os.environ``.
"""

from __future__ import annotations

import os
import socket
from typing import NoReturn


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
    """Tear the process group down (torch's and DeepSpeed's bookkeeping) at the end of a run.

    This does not stop gloo's threads: see :func:`exit_process`.
    """
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a stopped trainer: the exit work the interpreter would do, then ``os._exit(code)``.

    Why not a normal exit: each gloo process group runs C++ worker threads, and a worker drops
    its last reference to a finished collective only after the caller has its result. Where that
    collective's tensors outlived their Python objects (``broadcast_object_list``'s do, and the
    leader's ``stop`` is one), the drop takes the GIL. A rank that exits right after it (every
    rank but the leader, which still settles Kafka) can be in interpreter finalization by then;
    CPython (3.11 to 3.13) ends a thread that asks for the GIL there with ``pthread_exit``, whose unwind
    through the ``noexcept`` work destructor is ``std::terminate``. Core dump of such an abort
    (exit -6, "terminate called without an active exception"): main thread in
    ``Py_FinalizeEx``; the aborting thread in ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncBroadcastWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
    ``PyThread_exit_thread``. Those threads stop only in ``~ProcessGroupGloo``, which does not
    run before finalization: :func:`shutdown` leaves them running (the core has them all) and
    DeepSpeed keeps its groups (the engine, the ZeRO optimizer, every parameter's ``_dp_group``,
    ``deepspeed.utils.groups``), so the trainer has nothing to join them with.

    So the process ends before finalization, as a ``multiprocessing`` child does: the caller has
    closed the Kafka clients (the producer flushed) and the store's versions are committed; the
    interpreter's own pre-finalization steps run here (non-daemon threads joined, ``atexit``
    handlers, logging among them, run), then the standard streams are flushed.
    """
    import atexit
    import sys
    import threading

    threading._shutdown()  # Py_FinalizeEx's first two steps (a multiprocessing child runs this one)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can be said there
            pass
    os._exit(code)


def cpu_threads(n: int) -> None:
    """Set torch's intra-op threads on the CPU backend (0: leave torch's default)."""
    import torch

    if n > 0 and not torch.cuda.is_available():
        torch.set_num_threads(n)
