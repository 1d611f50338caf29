"""The life of a candidate version, as a table of allowed transitions (pure).

::

    candidate ─► gating ─► canary ─► awaiting_approval ─► promoted
        │           │         │  │           │
        │           ▼         │  └─► held ───┤ (inconclusive past the deadline: a person decides)
        │       rejected ◄────┤              ▼
        ▼   (gate failed, or  └────────► rolled_back (failed analysis, breached guardrail,
    superseded  a person)                             or a person)
    (a newer candidate arrived before this one was gated)

Under an auto-promote policy ``canary`` goes straight to ``promoted`` on a passing analysis.
``promoted``, ``rejected``, ``rolled_back`` and ``superseded`` are final. A transition to the state a
candidate is already in is a no-op (a repeated request, a controller redoing a step after a crash);
any other transition not in the table is refused with the reason, which the API answers as 409.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    CANDIDATE = "candidate"
    GATING = "gating"
    CANARY = "canary"
    AWAITING_APPROVAL = "awaiting_approval"
    HELD = "held"
    PROMOTED = "promoted"
    REJECTED = "rejected"
    ROLLED_BACK = "rolled_back"
    SUPERSEDED = "superseded"


FINAL = frozenset({State.PROMOTED, State.REJECTED, State.ROLLED_BACK, State.SUPERSEDED})

#: Who may move a candidate from each state, to where.
ALLOWED: dict[State, frozenset[State]] = {
    State.CANDIDATE: frozenset({State.GATING, State.SUPERSEDED, State.REJECTED}),
    State.GATING: frozenset({State.CANARY, State.REJECTED, State.SUPERSEDED}),
    # CANARY -> PROMOTED only under the auto-promote policy (release/actions.py); a person
    # approves a version awaiting approval or held, and may reject a running canary
    State.CANARY: frozenset({State.AWAITING_APPROVAL, State.PROMOTED, State.HELD, State.ROLLED_BACK, State.REJECTED}),
    State.AWAITING_APPROVAL: frozenset({State.PROMOTED, State.REJECTED, State.ROLLED_BACK}),
    State.HELD: frozenset({State.PROMOTED, State.ROLLED_BACK, State.REJECTED}),
    **{s: frozenset() for s in FINAL},
}

#: States in which a candidate serves canary traffic.
LIVE = frozenset({State.CANARY, State.AWAITING_APPROVAL, State.HELD})


class TransitionRefused(ValueError):
    """A transition the table does not allow; ``str()`` says why, for a person."""


def check(version: int, current: State, target: State) -> bool:
    """True when the transition is to be made, False when it is a no-op (already there);
    :class:`TransitionRefused` when it is not allowed."""
    if current == target:
        return False
    if target not in ALLOWED[current]:
        if current in FINAL:
            raise TransitionRefused(f"version {version} is already {current.value}: it cannot become {target.value}")
        raise TransitionRefused(f"version {version} is {current.value}: it cannot become {target.value} from there")
    return True
