"""Each canary user's one outcome, read at a fixed time and in a fixed order: outcome-blind windows.

The canary's accept-rate test (release/sequential.py) pairs one user of each arm and is valid
when which users pair never depends on what they said. Paired in the order reward settled their
signals, it did: rejects that come later than accepts (people take longer to complain) left one
arm's accepts waiting, so the next discordant pair went the same way, and identical versions
passed 0.066 to 0.133 of the time at alpha 0.05 (issue 45). So here (pure, no I/O; the tally of
release/measure.py drives it):

- **A user's window** opens at the completion of their first answer in the canary (``first_at``,
  serving's clock on the generation record: fixed before the user could say anything) and covers
  their answers completed within ``window_s`` after it, from the arm of that first answer.
- **Their outcome** is read when the clock passes ``first_at + window_s + settle_s``:
  ``settle_s`` is how long after an answer its episode can still reach the topic (ingest's join
  window and grace: an answer nobody rated leaves ingest, as a timed-out episode, only when its
  join window closes). It is the explicit signal of the earliest of those answers that has one
  (accept is an accept, reject and edit are not); **no explicit signal is no accept**. So every
  user who got an answer gives an outcome, whether or not and whenever they gave feedback:
  dropping silent users instead would let whether feedback comes decide who pairs (a version that
  makes unhappy users go quiet would look better).
- **Order.** Windows are read in the order of ``first_at`` (ties by user id), and
  release/sequential.py :class:`~release.sequential.Pairing` pairs them in that order. The reading
  time and the order are functions of answer times only, never of signals.
- **Late.** An episode that reaches the fold after its user's window was read counts for nothing
  more (a pair once formed is never rebuilt). A user whose first episode comes after users with
  later first answers were already read is counted apart (``late``), not entered out of order.
- **Switched arms.** A window holding answers of both arms (the routing changed while it was open:
  a user first answered by stable before serving loaded the canary, then routed to it) is counted
  apart (``switched``). Read as its first arm's, a signal on the other arm's answer made it a
  non-accept of the first arm, and only ever of stable's: it lowered stable's rate and favoured the
  canary.
- **Reward's judgement.** A signal counts only once reward judged it (its reward record arrived,
  so a flag on that very signal comes in time); a window whose signal reward has not judged waits,
  holding the windows after it, and is given up (``unjudged``, not counted, whatever the signal)
  ``JUDGE_WAIT_S`` after it was due.
- **New users.** Unless ``new_users`` says count them, a user counts only if a generation of theirs
  made before the canary started reached the fold (:meth:`Windows.know`): ids made up after the
  canary started (sock puppets that accept only canary answers) are counted apart (``new``), never
  as outcomes. The controller seeds the users seen before the start from the episodes of
  ``release.known_users_lookback_s`` before it (release/streams.py ``Streams.known_users``,
  :func:`most_recent`); the fold adds those whose pre-start episodes come after it.

The clock is the controller's, passed to :meth:`Windows.close` only once every record published
before it has been folded (release/streams.py), so a controller catching up on a backlog never reads
a window before its episodes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.settings import Settings

DECISIVE = ("accept", "reject", "edit")
#: How long a due window waits for reward's judgement of its signal before it is given up: reward
#: judges a signal within seconds, so past this it is down or failed on that record.
JUDGE_WAIT_S = 60.0
#: Open windows kept; past it a new user is counted apart (``late``), never the oldest dropped (the
#: order stays that of first answers). One per user active within ``window_s + settle_s``.
MAX_OPEN = 200_000
#: Users remembered as seen before the canary started (the most recent).
MAX_KNOWN = 200_000

#: Where each part of an open window sits in ``Windows.open[user]``: ``ARMS_AT`` maps each arm that
#: answered the user to its earliest answer's time.
ARM, FIRST_AT, OUT_AT, OUT_GID, OUT_ARM, SIGNAL, ARMS_AT = range(7)


class Kind(StrEnum):
    """What reading a user's window gave."""

    OUTCOME = "counted"  # an outcome: accepted or not
    NEW = "new"  # first seen after the canary started, under new_users = "exclude"
    UNJUDGED = "unjudged"  # its signal was never judged by reward in time
    SWITCHED = "switched"  # answers of both arms within the window


@dataclass(frozen=True)
class Read:
    """One user's window, read: ``accepted`` is meaningful for :attr:`Kind.OUTCOME` only."""

    user: str
    arm: str
    kind: Kind
    accepted: bool = False
    #: when the window's first answer completed
    first_at: float = 0.0


@dataclass
class Windows:
    """The open windows of one canary (module docstring); saved with the tally."""

    window_s: float = 0.0
    settle_s: float = 0.0
    #: whether users first seen after the canary started count (``release.new_users``)
    count_new_users: bool = True
    #: user -> [arm, first_at, out_at, out_gid, out_arm, signal, arms_at] while their window is open
    open: dict[str, list[Any]] = field(default_factory=dict)
    #: users seen before the canary started, oldest first
    known: deque[str] = field(default_factory=deque)
    #: ``first_at`` of the last window read: an entry before it would be out of order (late)
    read_through: float = 0.0
    #: the latest clock windows were closed at
    clock: float = 0.0

    def __post_init__(self) -> None:
        self._known = set(self.known)
        self._queue = [(w[FIRST_AT], user) for user, w in self.open.items()]
        heapq.heapify(self._queue)

    def know(self, user: str) -> None:
        """``user`` had a generation made before the canary started."""
        if user in self._known:
            return
        self._known.add(user)
        self.known.append(user)
        if len(self.known) > MAX_KNOWN:
            self._known.discard(self.known.popleft())

    def add(self, user: str, arm: str, done_at: float, gid: str, signal: str) -> bool:
        """Fold in one answer made for ``user`` in the canary (``signal``: its episode's, ``ignore``
        when it is not the user's own word). False: the user is late (module docstring)."""
        w = self.open.get(user)
        if w is None:
            if done_at < self.read_through or len(self.open) >= MAX_OPEN:
                return False
            w = self.open[user] = [arm, done_at, None, None, None, None, {}]
            heapq.heappush(self._queue, (done_at, user))
        elif done_at < w[FIRST_AT] and done_at >= self.read_through:
            # an earlier answer whose episode came later: the window starts there, and its arm is
            # the user's (the same arm unless the routing changed between the two answers)
            w[ARM], w[FIRST_AT] = arm, done_at
            heapq.heappush(self._queue, (done_at, user))
        if done_at < w[ARMS_AT].get(arm, float("inf")):
            w[ARMS_AT][arm] = done_at
        if signal in DECISIVE and (w[OUT_AT] is None or (done_at, gid) < (w[OUT_AT], w[OUT_GID])):
            w[OUT_AT], w[OUT_GID], w[OUT_ARM], w[SIGNAL] = done_at, gid, arm, signal
        return True

    def close(self, now: float, judged: Callable[[str], bool]) -> Iterator[Read]:
        """Read, in order of first answer, every window due by ``now`` (``judged(gid)``: whether
        reward judged that generation's signal)."""
        self.clock = max(self.clock, now)
        due = self.clock - self.window_s - self.settle_s
        while self._queue and self._queue[0][0] <= due:
            first_at, user = self._queue[0]
            w = self.open.get(user)
            if w is None or w[FIRST_AT] != first_at:
                heapq.heappop(self._queue)  # superseded by an earlier first answer
                continue
            if (self._signal(w) is not None and not self._switched(w) and not judged(w[OUT_GID])
                    and first_at > due - JUDGE_WAIT_S):
                return  # reward has not judged it yet: this window and those after it wait
            heapq.heappop(self._queue)
            del self.open[user]
            self.read_through = max(self.read_through, first_at)
            yield self._read(user, w, judged)

    def _signal(self, w: list[Any]) -> str | None:
        """The window's outcome signal: its earliest explicit one, of the window's arm, in time."""
        if w[SIGNAL] is None or w[OUT_ARM] != w[ARM] or w[OUT_AT] > w[FIRST_AT] + self.window_s:
            return None
        return w[SIGNAL]

    def _switched(self, w: list[Any]) -> bool:
        """Whether another arm than the window's answered the user within the window."""
        return any(arm != w[ARM] and at <= w[FIRST_AT] + self.window_s for arm, at in w[ARMS_AT].items())

    def _read(self, user: str, w: list[Any], judged: Callable[[str], bool]) -> Read:
        at = w[FIRST_AT]
        if not self.count_new_users and user not in self._known:
            return Read(user, w[ARM], Kind.NEW, first_at=at)
        if self._switched(w):
            return Read(user, w[ARM], Kind.SWITCHED, first_at=at)
        signal = self._signal(w)
        if signal is not None and not judged(w[OUT_GID]):
            return Read(user, w[ARM], Kind.UNJUDGED, first_at=at)
        return Read(user, w[ARM], Kind.OUTCOME, signal == "accept", first_at=at)

    def waiting(self) -> dict[str, int]:
        """Open windows per arm."""
        out: dict[str, int] = {}
        for w in self.open.values():
            out[w[ARM]] = out.get(w[ARM], 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "settle_s": self.settle_s, "count_new_users": self.count_new_users,
                "open": self.open, "known": list(self.known), "read_through": self.read_through,
                "clock": self.clock}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Windows:
        # a window saved by older code has no arms_at: its first arm only, as it was read then
        return cls(d["window_s"], d["settle_s"], d["count_new_users"],
                   {u: list(w) if len(w) > ARMS_AT else [*w, {w[ARM]: w[FIRST_AT]}] for u, w in d["open"].items()},
                   deque(d["known"]), d["read_through"], d["clock"])

    @classmethod
    def of(cls, settings: Settings) -> Windows:
        """The windows of a canary starting now: ``release.outcome_window_s`` long, read after
        ingest's join window and grace too (``settle_s``: when an unrated answer's episode leaves)."""
        return cls(settings.release.outcome_window_s, settings.ingest.window_s + settings.ingest.grace_s,
                   settings.release.new_users == "count")


def most_recent(last_seen: dict[str, float], n: int = MAX_KNOWN) -> list[str]:
    """The ``n`` users seen last (``last_seen``: user -> when), oldest first: the order
    :meth:`Windows.know` takes them in, so its bound drops the least recent first. Ties by user id,
    so the same episodes give the same set."""
    return [u for _, u in heapq.nlargest(n, ((t, u) for u, t in last_seen.items()))[::-1]]
