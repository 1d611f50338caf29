"""Decisions of the release controller, as they happen: counted for Prometheus and sent to the
``release.webhooks``.

A decision is an audit entry (release/store.py) that moves a candidate (a canary started, a version
superseded, held, rejected, rolled back, awaiting approval or promoted) or returns stable to an
earlier version (``undo``) or takes back a routing to stable that serving refused
(``serving_refused``: release/serving_state.py). The store hands every audit entry to its listeners once its transaction
has committed, so a decision is told exactly when it is durable, by the process that made it: the
controller loop's store for its own decisions and its policy's, the API's store for a person's.
Entries that decide nothing (a note, a pause, a lease taken over, a candidate recorded, a gate
started) are not decisions.

Each decision increments ``release_decisions_total{outcome, actor_kind}`` and, with webhooks
configured, becomes one JSON body per URL (:class:`Webhooks`)::

    {"text": "v7 rolled back by controller:host:ab12cd34: analysis fail: ...",
     "deployment": "flywheel", "audit_id": 42, "version": 7, "outcome": "rolled_back",
     "from_state": "canary", "to_state": "rolled_back", "actor": "...", "actor_kind": "controller",
     "reason": "...", "at": 1790000000.5}

``text`` is what a chat tool (Slack's and Mattermost's incoming webhooks read that field) shows;
``audit_id`` lets a receiver drop a body it got twice (a retry after a lost answer). ``text`` is
escaped for those chat formats (:func:`chat_text`): a person's reason is theirs to write, and must
not ping a channel or dress a link up in the controller's name. The other fields are data, as
written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from release.states import State
from release.store import SERVING_REFUSED, UNDO, ActorKind, AuditEntry, actor_kind

#: ``outcome`` of an undo (stable returned to an earlier version); the others are the target state.
UNDONE = "undone"
#: ``outcome`` of a stable routing serving refused, taken back to the version serving serves.
STABLE_KEPT = "serving_refused"
#: Transitions that are no decision: a candidate recorded, a gate started.
NOT_DECIDED = frozenset({State.CANDIDATE.value, State.GATING.value})


@dataclass(frozen=True)
class Decision:
    """One decision, as counted and sent (module docstring)."""

    audit_id: int
    version: int | None
    outcome: str
    from_state: str | None
    to_state: str | None
    actor: str
    actor_kind: ActorKind
    reason: str
    at: float

    @classmethod
    def of(cls, entry: AuditEntry) -> Decision | None:
        """The decision an audit entry records, or None when it records none."""
        if entry.to_state is not None and entry.to_state not in NOT_DECIDED:
            outcome = entry.to_state
        elif entry.evidence and UNDO in entry.evidence:
            outcome = UNDONE
        elif entry.evidence and SERVING_REFUSED in entry.evidence:
            outcome = STABLE_KEPT  # a routing serving refused, taken back (release/serving_state.py)
        else:
            return None
        return cls(entry.id, entry.version, outcome, entry.from_state, entry.to_state, entry.actor,
                   actor_kind(entry.actor), entry.reason, entry.at)

    def text(self) -> str:
        """One line a person reads in a chat: what happened to which version, who did it, why."""
        what = {"canary": "started as a canary", "awaiting_approval": "passed its canary and awaits approval",
                "held": "held for a person", "promoted": "promoted to stable", "rejected": "rejected",
                "rolled_back": "rolled back", "superseded": "superseded", UNDONE: "made stable again (undo)",
                STABLE_KEPT: "not made stable: serving refused it"}
        return f"v{self.version} {what.get(self.outcome, self.outcome)} by {self.actor}: {self.reason}"

    def body(self, deployment: str) -> dict[str, Any]:
        return {"text": chat_text(f"[{deployment}] {self.text()}"), "deployment": deployment, "audit_id": self.audit_id,
                "version": self.version, "outcome": self.outcome, "from_state": self.from_state,
                "to_state": self.to_state, "actor": self.actor, "actor_kind": self.actor_kind.value,
                "reason": self.reason, "at": self.at}


#: Line breaks and other control characters (Unicode's line and paragraph separators too): a
#: reason must not start a line of its own in the chat, where it could pass for another message.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
#: Word joiner: invisible, and no mention or link is read across it.
_JOINER = "\u2060"


def chat_text(text: str) -> str:
    """``text`` as Slack's mrkdwn and Mattermost's Markdown both show it as written, on one line.

    - ``&``, ``<``, ``>`` as ``&amp;``, ``&lt;``, ``&gt;``: Slack reads ``<...>`` as a control
      sequence (``<!channel>`` and ``<!here>`` ping everyone, ``<@U123>`` a person,
      ``<https://evil|Approve here>`` is a link labelled as anything) and wants those three
      escaped; CommonMark (Mattermost) shows the same entities as the characters.
    - a word joiner after an ``@`` that starts a word: Mattermost pings on ``@channel``,
      ``@here``, ``@all`` and ``@<user>`` (Slack only within ``<...>``, escaped above);
    - and between ``]`` and ``(``: a Markdown link ``[Approve here](https://evil)``;
    - control characters and line breaks as one space.
    """
    text = _CONTROL.sub(" ", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"(?<!\w)@(?=\w)", "@" + _JOINER, text)
    return text.replace("](", "]" + _JOINER + "(")


class DecisionCounter:
    """``release_decisions_total{outcome, actor_kind}``: an audit listener (``store.listeners``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter("release_decisions_total",
                             "Release decisions this process made, by outcome (the state a candidate moved to, or "
                             "undone) and by who made them (person, policy, controller)",
                             ["outcome", "actor_kind"], registry=registry)

    def __call__(self, entry: AuditEntry) -> None:
        decision = Decision.of(entry)
        if decision is not None:
            self.total.labels(decision.outcome, decision.actor_kind.value).inc()


__all__ = ["STABLE_KEPT", "UNDONE", "Decision", "DecisionCounter", "chat_text"]
