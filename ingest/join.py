"""Pure rules of the generation/feedback join: what a window is, and how signals are resolved.

These functions hold no state and do no I/O, so every rule is table-tested on its own
(tests/unit/test_ingest_join.py); ingest/stage.py applies them to the stream.

**Window.** A generation's window closes ``window_s`` after its ``completed_at`` (serving's
clock). Feedback counts for it when the user acted (``created_at``) no later than that deadline;
feedback created later is ``late_feedback`` (dead-lettered: it is a real signal, kept for audit,
never silently dropped). Feedback that arrives before its generation waits ``orphan_wait_s`` after
it arrived (or after its ``created_at``, if that is later); if the generation has not come by then
it is ``orphan_feedback``. The wait runs from arrival so that a replayed orphan waits afresh for a
generation that is still to come: counted from ``created_at``, it would be an orphan again at once.

**Closing** (:func:`closes_at`). A window closes ``grace_s`` after its deadline, and never sooner
than ``window_s`` after its generation reached the stage. The second bound is for generations
that arrive late: after a broker outage, serving replays its journal, and a generation and its
feedback (often recorded by different replicas) reach the stage minutes late and seconds or
minutes apart. Closed at once, such a generation turned the in-time feedback behind it into
``late_feedback``. The wait is measured on the stage's clock from arrival, as the orphan wait is;
which feedback counts is still decided by ``created_at`` against the deadline, so a late
generation only holds its window open longer, it never admits feedback acted on too late.

**Clock skew.** A record stamped more than ``max_future_s`` ahead of the stage's clock is
``clock_skew`` (dead-lettered): its window would stay open, and hold join state, until then.

**Emission.** An episode is emitted once, when the window closes (plus ``grace_s`` for clock skew
and transport delay), not on the first feedback: waiting lets late duplicates and conflicting
signals fold into the one episode instead of producing a second, contradictory one. The cost is
``window_s`` of latency per episode (measured from whichever is later, the generation's
completion or its arrival).

**Early emission** (:func:`closes_on_signal`, ``ingest.emit_after_signal_s``). Where that
latency matters more than a changed mind, the window closes ``emit_after_signal_s`` after the
first decisive signal reached the stage (with both the generation and the signal present), if
that is sooner. Signals arriving in that time still fold in by the rule below; one arriving
after the episode left is dead-lettered as ``late_feedback``, kept for audit like any late
signal, never a second episode. The episode is still emitted exactly once.

**Resolution** (:func:`resolve`): duplicates (same ``feedback_id``) count once; an id already
waiting on another generation is no duplicate but a collision, dead-lettered as
``reused_feedback_id`` by the stage (as is, for generations, an id that names another open
generation with different content: ``reused_generation_id``). Decisive signals
(accept, reject, edit) beat an explicit ``ignore``. Among decisive signals the latest by
``created_at`` wins (ties: the larger ``feedback_id``, so the result never depends on arrival
order); an ``edit`` winner carries its text, and the winner's ``user_id`` is the episode's
``rater_id``. ``conflicted`` is True when the decisive signals
disagree (different signals, or edits with different texts). With no feedback at all the
episode is ``ignore`` with ``timed_out=True``. Feedback marked ``other_user`` (serving recorded a
user's feedback on another user's answer, ``serve.feedback_other_user = "record"``) is left out,
as if it never came: it is kept on the feedback topic for audit, never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from flywheel.contracts import FeedbackEvent

DECISIVE = frozenset({"accept", "reject", "edit"})


@dataclass(frozen=True)
class Resolution:
    """The one signal an episode carries, and how it was reached."""

    signal: str
    edited_text: str | None
    decision_ms: float | None
    feedback_ids: tuple[str, ...]
    timed_out: bool
    conflicted: bool
    #: ``user_id`` of the winning feedback: who judged the generation.
    rater_id: str | None = None


def generation_deadline(completed_at: float, window_s: float) -> float:
    """Latest user-action time (``created_at``) that still counts for a generation."""
    return completed_at + window_s


def orphan_deadline(feedback_created_at: float, arrived_at: float, wait_s: float) -> float:
    """When feedback without its generation gives up waiting and becomes an orphan."""
    return max(feedback_created_at, arrived_at) + wait_s


def is_from_future(stamped_at: float, now: float, max_future_s: float) -> bool:
    """A record's time is further ahead of the stage's clock than clock skew explains."""
    return stamped_at - now > max_future_s


def is_late(feedback_created_at: float, deadline: float) -> bool:
    return feedback_created_at > deadline


def closes_at(deadline: float, arrived_at: float, window_s: float, grace_s: float) -> float:
    """When a generation's window closes, on the stage's clock: ``grace_s`` after its deadline,
    and no sooner than ``window_s`` after the generation arrived (``arrived_at``)."""
    return max(deadline + grace_s, arrived_at + window_s)


def closes_on_signal(close_at: float, signal: str, now: float, emit_after_s: float | None) -> float:
    """When a window closes once ``signal`` is present for it at ``now`` (stage's clock): sooner
    under early emission for a decisive signal, else unchanged."""
    if emit_after_s is None or signal not in DECISIVE:
        return close_at
    return min(close_at, now + emit_after_s)


def signal_of(fb: FeedbackEvent) -> str:
    """The signal ``fb`` gives its generation, for early emission: none (``ignore``) when it is
    another user's (``other_user``), which must not close the owner's window either."""
    return "ignore" if fb.other_user else fb.signal


def _order(fb: FeedbackEvent) -> tuple[float, str]:
    return (fb.created_at, fb.feedback_id)


def resolve(feedback: list[FeedbackEvent]) -> Resolution:
    """Fold a generation's feedback into one signal (rule in the module docstring)."""
    unique: dict[str, FeedbackEvent] = {}
    for fb in feedback:
        if not fb.other_user:  # another user's, recorded for audit only: no judgement of this answer
            unique.setdefault(fb.feedback_id, fb)
    if not unique:
        return Resolution("ignore", None, None, (), timed_out=True, conflicted=False)
    ids = tuple(sorted(unique))
    decisive = [fb for fb in unique.values() if fb.signal in DECISIVE]
    pool = decisive or list(unique.values())
    winner = max(pool, key=_order)
    opinions = {(fb.signal, fb.edited_text if fb.signal == "edit" else None) for fb in decisive}
    return Resolution(
        signal=winner.signal,
        edited_text=winner.edited_text if winner.signal == "edit" else None,
        decision_ms=winner.decision_ms,
        feedback_ids=ids,
        timed_out=False,
        conflicted=len(opinions) > 1,
        rater_id=winner.user_id or None,  # (an empty user names no one)
    )
