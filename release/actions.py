"""What a person (or the controller) can do to a candidate, each one transition of the store with
the routing it implies. The REST API, the CLI (through the API) and the controller all call these,
so a rule lives in one place.

A refused action raises :class:`ActionRefused` with a reason a person can act on; the API answers
it with 409.
"""

from __future__ import annotations

import re
from typing import Any

from release.states import LIVE, State, TransitionRefused
from release.store import BackToStable, Candidate, ReleaseStore, Revision, Routing


class ActionRefused(ValueError):
    """The action cannot be taken now; ``str()`` says why."""


def promote(store: ReleaseStore, version: int, actor: str, reason: str, interval_s: float,
            evidence: dict[str, Any] | None = None, by_policy: bool = False) -> None:
    """Make ``version`` stable and end its canary: a person's approval of a version awaiting it
    (or held), or the auto-promote policy (``by_policy``) on a canary whose analysis passed."""
    cand = _known(store, version)
    allowed = (State.AWAITING_APPROVAL, State.HELD, State.CANARY) if by_policy else (State.AWAITING_APPROVAL, State.HELD)
    if cand.state not in allowed:
        raise ActionRefused(f"version {version} is {cand.state.value}: only a version awaiting approval "
                            "(or held for a decision) can be promoted")
    _move(store, version, State.PROMOTED, actor, reason, evidence, Routing(version, None, 0.0), interval_s)


def reject(store: ReleaseStore, version: int, actor: str, reason: str) -> None:
    """Turn ``version`` down; if it serves canary traffic, that traffic goes back to stable (decided
    inside the transaction: the gate may start its canary between any read here and it)."""
    _known(store, version)
    _move(store, version, State.REJECTED, actor, reason, None, BackToStable())


def rollback(store: ReleaseStore, actor: str, reason: str, evidence: dict[str, Any] | None = None,
             version: int | None = None) -> int:
    """Send every user back to stable, ending the live canary (``version``, or whichever is live);
    returns the version rolled back. A routing that still names a version no longer live as its
    canary (left by an older release of this code) is ended too: rollback always can."""
    live = [c for c in store.candidates(set(LIVE)) if version is None or c.version == version]
    if not live:
        stray = store.unroute_canary(actor, reason, version)
        if stray is None:
            raise ActionRefused("no canary is live: there is nothing to roll back" if version is None
                                else f"version {version} is not serving canary traffic")
        return stray
    cand = live[-1]
    _move(store, cand.version, State.ROLLED_BACK, actor, reason, evidence, BackToStable())
    return cand.version


def undo_target(store: ReleaseStore, version: int) -> Candidate:
    """The candidate ``undo`` would make stable, when the rules allow it now (checked again, inside
    the transaction, by :func:`undo`): a version promoted before, not stable already."""
    cand = _known(store, version)
    if cand.state != State.PROMOTED:
        raise ActionRefused(f"version {version} is {cand.state.value}: only a version promoted before can be "
                            "stable again")
    if store.stable_version() == version:
        raise ActionRefused(f"version {version} is already stable")
    live = store.candidates(set(LIVE))
    if live:
        raise ActionRefused(f"a canary is live (v{live[-1].version}): roll it back first, then undo")
    return cand


def undo(store: ReleaseStore, version: int, actor: str, reason: str) -> Revision:
    """Return stable to ``version``, promoted before (verified by the caller); the new revision.
    Refused while a canary is live: roll it back first (release/store.py ``undo``)."""
    try:
        return store.undo(version, actor, reason)
    except TransitionRefused as exc:
        raise ActionRefused(str(exc)) from None


def verification_refused(version: int, exc: BaseException) -> ActionRefused:
    """The refusal of an undo whose version failed verification, as approvers read it (the 409,
    the audit note): the error's type and text with every filesystem path cut to its last part.
    The text names what failed (a hash mismatch, a missing file) and which file; where the
    checkpoint store or the rebuild's temporary directory lives is the server's business, and the
    caller logs the error whole for the operator."""
    return ActionRefused(f"version {version} failed verification, stable stays: "
                         f"{type(exc).__name__}: {without_paths(str(exc))}")


#: An absolute path, or a URI's authority and path (``file:///srv/ckpt/v1``, ``s3://bucket/v1``):
#: a ``/`` not inside a word or a number (so ``1/2`` stays), up to a blank, a quote or the
#: punctuation that ends a path in an error's text (``{directory}: {name} hash mismatch``).
_PATH = re.compile(r"""(?:\b[A-Za-z][\w+.-]*://[^\s/'"]*|(?<![\w.]))/[^\s'"():,;]*""")


def without_paths(text: str) -> str:
    """``text`` with each path in it replaced by its last part (``/srv/ckpt/v1/model.safetensors``
    reads ``model.safetensors``; ``/`` alone reads ``""``)."""
    return _PATH.sub(lambda m: m.group(0).rstrip("/").rpartition("/")[2], text)


def pause(store: ReleaseStore, actor: str, reason: str) -> bool:
    """Stop the pipeline from starting gates and canaries (a live canary keeps being measured and
    is still rolled back on a failure); False when it was paused already."""
    return store.set_paused(True, actor, reason or "no reason given")


def resume(store: ReleaseStore, actor: str, reason: str) -> bool:
    return store.set_paused(False, actor, reason or "no reason given")


def _known(store: ReleaseStore, version: int) -> Candidate:
    cand = store.get(version)
    if cand is None:
        raise ActionRefused(f"no version {version} was ever published to this controller")
    return cand


def _move(store: ReleaseStore, version: int, target: State, actor: str, reason: str,
          evidence: dict[str, Any] | None, routing: Routing | BackToStable | None,
          interval_s: float | None = None) -> None:
    try:
        if not store.transition(version, target, actor, reason, evidence, routing, interval_s):
            raise ActionRefused(f"version {version} is already {target.value}")
    except TransitionRefused as exc:
        raise ActionRefused(str(exc)) from None
