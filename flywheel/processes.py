"""Process lifetimes on Linux: a child that dies with its parent, and what a process group left.

Used where one process starts others that must not outlive it: serving's vLLM engines
(serving/tether.py) and ``flywheel up``'s children (local/up.py). Read from ``/proc``: the
process table is the truth (a port freed says nothing of a process still holding 2 GB).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send this process ``sig`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
    False where that cannot be asked (not Linux).

    The kernel watches the parent *thread* that forked this process, not the parent process:
    call it only in a child started by a thread that lives as long as the child should.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``, from ``/proc``. A zombie is not one: it holds
    no memory, only its exit status, until its parent (init, for an orphan) collects it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split(" ", 3)[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def kill_group(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every live process of group ``pgid`` and wait until ``/proc`` shows none (at most
    ``timeout_s``); returns the pids that were there. SIGKILL because what is left is what did
    not stop with its leader, and vLLM's engine processes ignore SIGTERM."""
    left = group_members(pgid)
    if not left:
        return []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return left
        if not group_members(pgid) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
