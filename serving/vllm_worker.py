"""Set-up that must run inside each vLLM worker process, loaded as its ``worker_extension_cls``.

vLLM imports this module in the worker before the worker loads and runs the model, so importing
it is the hook for the AMX request below; :class:`WorkerSetup` adds one method to the worker,
the weight swap serving calls (:meth:`WorkerSetup.reload_weights_tied`).

**AMX permission.** Linux lets a process execute Intel AMX tile instructions only after the
process asks for them (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and the grant
does not pass to a spawned process. On a CPU with AMX, vLLM's CPU attention takes its AMX path
for bf16 models, but its worker never asks: unless some other library in the worker happened to
ask first, the first attention call dies of SIGILL and the engine with it ("Worker proc ...
died unexpectedly (exit code: -4)", then ``EngineDeadError`` on every request). Asking costs one
system call and is harmless where AMX is absent or already granted.

**Tied weights across a swap.** A model that ties its output head to its input embeddings
(``tie_word_embeddings``: SmolLM2, Llama 3.2 1B) holds one parameter under two names, and its
checkpoints carry it once, under the embeddings' name. vLLM 0.32's in-place reload loads that
name and rebuilds the kernels of the modules it loaded; on the CPU the output head computes from
a copy of its weight packed for its GEMM kernel when the model loaded, never rebuilt by a reload.
After a swap the engine embedded with the new version and predicted with the old head: measured
on a tied model, a served logprob equal to new embeddings with the old head to 1e-6, and 4.3 nats
from the new version's own; with :func:`retie` it matches the new version to 1e-6. The tie
itself held there; :func:`retie` also mends one a reload leaves broken.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from typing import Any

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_has_amx(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists AMX tiles among its CPU flags."""
    return any(line.startswith("flags") and "amx_tile" in line.split(":", 1)[-1].split()
               for line in cpuinfo.splitlines())


def request_amx() -> bool:
    """Ask the kernel for AMX tile state for this process; True when granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as fh:
            if not cpu_has_amx(fh.read()):
                return False
    except OSError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("the kernel refused AMX tile state (errno %d): vLLM's AMX kernels may fail",
                    ctypes.get_errno())
        return False
    return True


request_amx()


def tie_groups(model: Any) -> list[tuple[list[str], Any]]:
    """Names that share one parameter, with that parameter (``[(names, parameter)]``)."""
    groups: dict[int, tuple[list[str], Any]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), ([], param))[0].append(name)
    return [(names, param) for names, param in groups.values() if len(names) > 1]


def retie(model: Any, groups: list[tuple[list[str], Any]]) -> list[str]:
    """Tie again what ``groups`` (taken before a reload) tied, and rebuild what was built from it.

    Where the reload left the tie broken, each name still holding the old parameter is pointed at
    the one it loaded; where it kept the tie, the names after the first are the aliases (vLLM ties
    the head to the embeddings, which checkpoints carry). Each alias's module then rebuilds its
    kernel from the weight (``quant_method.process_weights_after_loading``: on the CPU the output
    head packs its weight for its GEMM kernel, and a reload rebuilds only the modules it loaded). A group
    whose names were each loaded on their own is left as it is. Returns the aliases tied again.
    """
    done = []
    for names, old in groups:
        now = {name: model.get_parameter(name) for name in names}
        loaded = {id(p): p for p in now.values() if p is not old}
        if len(loaded) > 1:
            continue
        aliases = [n for n, p in now.items() if p is old] if loaded else names[1:]
        for name in aliases:
            parent, _, attr = name.rpartition(".")
            module = model.get_submodule(parent)
            if loaded:
                setattr(module, attr, next(iter(loaded.values())))
            method = getattr(module, "quant_method", None)
            if hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
            done.append(name)
    return done


class WorkerSetup:
    """Mixed into vLLM's worker class (its ``self`` is the worker)."""

    def reload_weights_tied(self, weights_path: str) -> None:
        """vLLM's in-place reload from a checkpoint directory, with tied weights tied again."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        groups = tie_groups(model)
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)  # type: ignore[attr-defined]
        tied = retie(model, groups)
        if tied:
            log.info("tied %s to the reloaded weights again", ", ".join(tied))
