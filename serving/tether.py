"""vLLM's engine processes die with the serving process that started them, however it dies.

vLLM runs each engine as a child process (``VLLM::EngineCore``, started by multiprocessing with
``EngineCoreProc.run_engine_core`` as its target), which starts its model worker
(``VLLM::Worker``, target ``WorkerProc.worker_main``). Nothing in them watches the serving process:
after a kill -9 of ``flywheel serve`` both are re-parented to init, ignore SIGTERM and hold their
memory (about 1.9 GB a pair on the CPU build), and ``flywheel up`` restarting serving would leak a
pair per engine per restart.

:func:`tether_engines`, called in serving before its engines start, replaces both targets with
wrappers that first ask Linux to SIGKILL the process when its parent dies
(``PR_SET_PDEATHSIG``: flywheel/processes.py), then run vLLM's own. The engine dies with serving,
the worker with its engine. The wrappers are functions of this module, so the targets are found
by name in a process started by ``spawn`` as well as copied by ``fork``.

The signal watches the parent *thread* that started the process. Serving starts its engines on
its :class:`~serving.server.LoopThread`, which runs until the engines are shut down (serving/main.py);
vLLM starts its workers on the engine process's main thread.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

from flywheel.processes import set_parent_death_signal

#: (class, method name) -> vLLM's own target, kept where the patch was made (a forked child
#: inherits it; a spawned one imports vLLM afresh and finds vLLM's own on the class).
_ORIGINALS: dict[tuple[type, str], Callable[..., Any]] = {}


def tether_engines() -> None:
    """Make every vLLM engine this process starts from now on die with it (module docstring)."""
    from vllm.v1.engine.core import EngineCoreProc

    _replace(EngineCoreProc, "run_engine_core", run_engine_core)


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """``EngineCoreProc.run_engine_core``, in a process that dies with serving."""
    _die_with_parent()
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _replace(WorkerProc, "worker_main", worker_main)  # before the engine starts its workers
    return _original(EngineCoreProc, "run_engine_core")(*args, **kwargs)


def worker_main(*args: Any, **kwargs: Any) -> Any:
    """``WorkerProc.worker_main``, in a process that dies with its engine."""
    _die_with_parent()
    from vllm.v1.executor.multiproc_executor import WorkerProc

    return _original(WorkerProc, "worker_main")(*args, **kwargs)


def _die_with_parent() -> None:
    set_parent_death_signal(signal.SIGKILL)  # SIGKILL: vLLM's processes ignore SIGTERM
    # the parent may have died before the request above: then nothing will ever be sent
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _replace(cls: type, name: str, wrapper: Callable[..., Any]) -> None:
    if cls.__dict__[name].__func__ is wrapper:
        return
    _ORIGINALS[(cls, name)] = cls.__dict__[name].__func__
    setattr(cls, name, staticmethod(wrapper))


def _original(cls: type, name: str) -> Callable[..., Any]:
    own = _ORIGINALS.get((cls, name))
    return own if own is not None else cls.__dict__[name].__func__
