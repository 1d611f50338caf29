"""Set-up that must run inside each vLLM worker process, loaded as its ``worker_extension_cls``.

vLLM imports this module in the worker before the worker loads and runs the model, so importing
it is the hook; :class:`WorkerSetup` adds nothing to the worker.

**AMX permission.** Linux lets a process execute Intel AMX tile instructions only after the
process asks for them (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and the grant
does not pass to a spawned process. On a CPU with AMX, vLLM's CPU attention takes its AMX path
for bf16 models, but its worker never asks: unless some other library in the worker happened to
ask first, the first attention call dies of SIGILL and the engine with it ("Worker proc ...
died unexpectedly (exit code: -4)", then ``EngineDeadError`` on every request). Asking costs one
system call and is harmless where AMX is absent or already granted.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

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


class WorkerSetup:
    """Mixed into vLLM's worker class; importing this module did the work."""
