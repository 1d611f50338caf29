"""What the controller does about serving's report on a release (pure; table-tested).

Serving reports every release it applies or refuses on ``flywheel.serving-status``
(:class:`~flywheel.contracts.ServingStatusEvent`). The controller reads them each turn
(release/streams.py) and asks :func:`respond` what to do, given what its store says now:

- a refusal of a release whose canary is still the live canary -> **roll the canary back** at once,
  with serving's reason: a canary serving will not run gets no users, and left alone it would idle
  to its deadline (``release.canary_max_s``);
- a refusal of a release that moved stable to a version serving does not serve (a promotion, an
  undo), while that is still the newest routing and names no canary -> **keep serving's stable**: a
  new routing back to the version serving's stable route still serves, so the controller's view of
  stable is what users get. Only to a version the controller itself once routed as stable: a
  status record is not signed (docs/signing.md), and one forged must not choose weights;
- anything else (an applied release; a refusal already overtaken by a newer decision) -> nothing.

Each rule reads the store's present state, so reading a status twice (a restart before its offset
was saved) acts once: the canary is no longer live, the routing no longer the refused one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from flywheel.contracts import ServingStatusEvent
from release.store import Revision


class Act(StrEnum):
    NOTHING = "nothing"
    ROLL_BACK_CANARY = "rolled_back"
    KEEP_SERVING_STABLE = "stable_kept"


@dataclass(frozen=True)
class Response:
    act: Act
    #: The canary to roll back, or the version stable goes back to.
    version: int | None = None
    #: For the audit log: what serving said, in its words.
    reason: str = ""


def refusal_words(status: ServingStatusEvent) -> str:
    return (f"serving ({status.instance}) refused revision {status.revision}: version {status.refused_version} "
            f"{status.reason}: {status.detail}")


def respond(status: ServingStatusEvent, live_canary: int | None, latest: Revision | None,
            was_stable: Callable[[int], bool]) -> Response:
    """See the module docstring. ``live_canary``: the candidate serving canary traffic in the store
    (None: none); ``latest``: the newest routing decided; ``was_stable(v)``: whether a routing of
    this controller ever made ``v`` stable (version 0, the model directory, always was)."""
    if status.outcome != "refused" or latest is None:
        return Response(Act.NOTHING)
    words = refusal_words(status)
    if (status.canary_version is not None and status.canary_version == live_canary
            and latest.canary_version == live_canary):
        return Response(Act.ROLL_BACK_CANARY, live_canary, words)
    kept = status.serving_stable_version
    if (status.stable_version != kept and latest.revision == status.revision and latest.canary_version is None
            and latest.stable_version == status.stable_version and (kept == 0 or was_stable(kept))):
        return Response(Act.KEEP_SERVING_STABLE, kept, words)
    return Response(Act.NOTHING, None, words)
