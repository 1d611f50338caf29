"""Who gets which version, and how engine slots change to follow a release: pure functions.

**Users.** :func:`arm_of` (serving/arms.py) sends a user to
the canary when a hash of the split's salt and their pseudonymous id, read as a number in [0, 1),
is below ``canary_share``. The salt is derived from the one on the release record
(``ReleaseEvent.canary_salt``) under the routing secret (``serving.arms.split_salt``), so the
split is never readable from a topic; the controller gives each canary its own, so each
canary draws a fresh split of the users (with one fixed hash the same users were the canary arm
in every canary, and one unlucky split, an abusive user on the canary side, biased every verdict
alike), while within one canary the same user lands on the same side for as long as the share
holds, in every serving process (sha256, not Python's salted ``hash``), and raising the share only
moves users from stable to canary, never back. No salt (a record from before salts) hashes as
before.

**Slots.** Serving runs one or two engines ("slots"); each holds one version at a time.
:func:`plan` turns what the slots hold, which slot serves which route now, and the release
wanted into loads and routings, in an order that never sends a user to a slot while it loads a
version other than the one that user's route names:

- an idle slot loads first, while the other keeps serving, and takes its route only once loaded
  (a new canary, or a new stable while no canary runs, costs users no pause at all);
- a slot that already holds a wanted version is relabelled, not reloaded (promoting the canary
  makes its slot stable; rolling back just stops routing to it);
- a slot whose route stays the same while its version changes is reloaded in place: its
  requests pause for the reload and finish on the new weights (``serving.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# the split's hash and key (serving/arms.py); imported here for serving's other modules
from serving.arms import Arm, arm_of, bucket

__all__ = ["Arm", "Routing", "Step", "Want", "arm_of", "bucket", "canary_unservable", "plan"]


@dataclass(frozen=True)
class Routing:
    """Which slot answers each route; ``canary`` None sends everyone to ``stable``. ``salt`` picks
    which users the share takes (:func:`arm_of`)."""

    stable: int
    canary: int | None = None
    share: float = 0.0
    salt: str = ""

    def role_of(self, slot: int) -> Arm | None:
        if slot == self.stable:
            return "stable"
        return "canary" if slot == self.canary else None


@dataclass(frozen=True)
class Want:
    """The versions a release asks for."""

    stable: int
    canary: int | None = None
    share: float = 0.0
    salt: str = ""


@dataclass(frozen=True)
class Step:
    """Route by ``routing``; then, if ``load`` is set, load ``version`` into ``slot``."""

    routing: Routing
    load: tuple[int, int] | None = None


def plan(held: list[int], now: Routing, want: Want) -> list[Step]:
    """Steps from ``now`` (slot ``i`` holds version ``held[i]``) to ``want``; the last step's routing
    is the final one and loads nothing. With one slot a wanted canary is left out: the caller says
    so (:func:`canary_unservable`)."""
    st = _stable_slot(held, now, want)
    ca = _canary_slot(held, st, want)
    final = Routing(st, ca, want.share, want.salt) if ca is not None else Routing(st)
    loads = [(i, v) for i, v in ((st, want.stable), (ca, want.canary)) if i is not None and v is not None and held[i] != v]
    # idle slots first: by the time a serving slot changes route, the slot taking over is ready
    loads.sort(key=lambda load: now.role_of(load[0]) is not None)
    steps, routing = [], now
    for slot, version in loads:
        role, role_after = routing.role_of(slot), final.role_of(slot)
        if role == "stable" and role_after != "stable":
            canary = routing.canary if routing.canary != st else None
            routing = replace(routing, stable=st) if canary is not None else Routing(st)
        elif role == "canary" and role_after != "canary":
            routing = Routing(routing.stable)
        steps.append(Step(routing, (slot, version)))
    steps.append(Step(final))
    return steps


def canary_unservable(held: list[int], want: Want) -> bool:
    """A canary is wanted but there is no second slot to serve it from."""
    return want.canary is not None and len(held) < 2


def _stable_slot(held: list[int], now: Routing, want: Want) -> int:
    holding = [i for i, v in enumerate(held) if v == want.stable]
    if now.stable in holding:
        return now.stable
    if holding:
        return holding[0]
    idle = [i for i, v in enumerate(held) if now.role_of(i) is None and v != want.canary]
    return idle[0] if idle else now.stable


def _canary_slot(held: list[int], stable_slot: int, want: Want) -> int | None:
    if want.canary is None or len(held) < 2:
        return None
    others = [i for i in range(len(held)) if i != stable_slot]
    holding = [i for i in others if held[i] == want.canary]
    return holding[0] if holding else others[0]
