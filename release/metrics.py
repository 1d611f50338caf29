"""The release controller's metrics (``release_*``), beside the API's own (release/api.py) and the
decisions' (release/decisions.py, release/webhooks.py).

Two kinds:

- :class:`ControllerMetrics`: what this process's controller loop does, kept in memory: whether
  it holds the lease (``release_lease_held``, 1 on exactly one replica of a healthy deployment),
  each gate's duration and verdict, and what serving reported (release/serving_state.py):
  refusals by what the controller did about them, and the newest revision serving applied.
- :class:`StoreCollector`: what the database says, read at every scrape (a handful of small
  queries): candidates by state, the live canary's evidence (e-values, confidence band, each
  arm's accept rate and counts, its users per arm and the sample-ratio e-value), how long the
  live candidate has been in its state, and the
  routing revision decided and the newest one the broker acknowledged. Every replica reads the
  same database and exports the same values, so rules take ``max`` of them, never ``sum``.

dashboards/ draws them and alerts on them (dashboards/runbooks/release-*.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from release.serving_state import Act
from release.states import LIVE, State
from release.store import Candidate, ReleaseStore

log = logging.getLogger(__name__)

#: A gate takes seconds on a small model and minutes on a large one.
GATE_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class ControllerMetrics:
    """The controller loop's own (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lease_held = Gauge("release_lease_held",
                                "1 while this replica holds the controller lease and acts, 0 while it stands by",
                                registry=registry)
        self.gate_seconds = Histogram("release_gate_seconds", "Duration of each offline gate, failed ones included",
                                      buckets=GATE_BUCKETS, registry=registry)
        self.gate_verdicts = Counter("release_gate_verdicts_total",
                                     "Offline gate verdicts: pass, fail, or error (the gate could not be measured)",
                                     ["outcome"], registry=registry)
        self.serving_refusals = Counter(
            "release_serving_refusals_total",
            "Releases serving reported it refused, by what this controller did: rolled_back (the canary), "
            "stable_kept (a promotion taken back to what serving serves), nothing (overtaken by a newer decision)",
            ["action"], registry=registry)
        for act in Act:
            self.serving_refusals.labels(act.value)
        self.serving_applied = Gauge("release_serving_revision_applied",
                                     "Newest routing revision a serving instance reported applied (-1: none heard "
                                     "by this replica)", registry=registry)
        self.serving_applied.set(-1)
        self.announcements = Counter(
            "release_routing_announcements_total",
            "The current routing sent again on the releases topic (at the lease's take and every "
            "release.reannounce_s), by outcome: sent (acked), failed (not acked: tried again sooner)",
            ["outcome"], registry=registry)
        for outcome in ("sent", "failed"):
            self.announcements.labels(outcome)
        self.stalled = Gauge("release_stalled_seconds",
                             "Seconds this replica's controller turns have failed on the release database in a "
                             "row: not answering, read-only, full (0 while it works)", registry=registry)


class StoreCollector(Collector):
    """Gauges read from the database at scrape time (module docstring). ``lock`` is the lock the
    store's other user (the API) holds around its transactions: one connection, one at a time."""

    def __init__(self, store: ReleaseStore, lock: threading.Lock) -> None:
        self.store, self.lock = store, lock

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are fixed, and the database may be down

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("release_database_up", "1 when the release database answered this scrape")
        try:
            with self.lock:
                families = list(self._read(time.time()))
        except Exception:  # a database down is a metric, not a failed scrape that hides every other
            log.warning("/metrics: the release database did not answer", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self, now: float) -> Iterator[Metric]:
        store = self.store
        counts = store.state_counts()
        by_state = GaugeMetricFamily("release_candidates", "Candidate versions by state", labels=["state"])
        for state in State:
            by_state.add_metric([state.value], counts.get(state, 0))
        yield by_state
        rev, published = store.latest_revision(), store.newest_published()
        revision = GaugeMetricFamily("release_routing_revision",
                                     "Routing revision: decided (the newest the controller wrote) and published "
                                     "(the newest the broker acknowledged on the releases topic)", labels=["phase"])
        revision.add_metric(["decided"], rev.revision if rev else 0)
        revision.add_metric(["published"], published or 0)
        yield revision
        paused = GaugeMetricFamily("release_pipeline_paused", "1 while an admin has paused gates and canaries")
        paused.add_metric([], int(store.paused()))
        yield paused
        live = store.candidates(set(LIVE))
        yield from _canary(store, live[-1] if live else None, now)


def _canary(store: ReleaseStore, cand: Candidate | None, now: float) -> Iterator[Metric]:
    version = GaugeMetricFamily("release_canary_version", "The live canary's version (-1: none)")
    version.add_metric([], cand.version if cand else -1)
    yield version
    seconds = GaugeMetricFamily("release_state_seconds",
                                "Seconds the live candidate has been in its state (0 for the states it is not in)",
                                labels=["state"])
    entered = store.entered_at(cand.version, cand.state) if cand else None
    for state in sorted(LIVE):
        seconds.add_metric([state.value], max(0.0, now - entered) if cand and state == cand.state and entered else 0.0)
    yield seconds
    analysis = (cand.analysis if cand else None) or {}
    if "e_better" not in analysis:
        return  # no measurement yet: no evidence to show
    e = GaugeMetricFamily("release_canary_e_value", "The live canary's e-values against equal accept rates, "
                          "for better and for worse (a verdict at 1/alpha)", labels=["direction"])
    e.add_metric(["better"], float(analysis["e_better"]))
    e.add_metric(["worse"], float(analysis["e_worse"]))
    yield e
    band = GaugeMetricFamily("release_canary_band", "The live canary's always-valid confidence band on its win "
                             "share among discordant pairs (0.5: no difference)", labels=["bound"])
    lo, hi = analysis.get("band") or (0.0, 1.0)
    band.add_metric(["lower"], float(lo))
    band.add_metric(["upper"], float(hi))
    yield band
    rate = GaugeMetricFamily("release_canary_accept_rate", "Accept rate of each arm of the live canary",
                             labels=["arm"])
    outcomes = GaugeMetricFamily("release_canary_outcomes", "Accepts, rejects and edits counted in each arm of "
                                 "the live canary", labels=["arm"])
    accepts = GaugeMetricFamily("release_canary_accepts", "Accepts counted in each arm of the live canary",
                                labels=["arm"])
    users = GaugeMetricFamily("release_canary_users", "Users served in each arm of the live canary (the sample-ratio "
                              "check compares them with the share the routing asked for)", labels=["arm"])
    for arm in ("stable", "canary"):
        stats = analysis.get(arm) or {}
        rate.add_metric([arm], float(stats.get("accept_rate", 0.0)))
        outcomes.add_metric([arm], float(stats.get("outcomes", 0)))
        accepts.add_metric([arm], float(stats.get("accepts", 0)))
        users.add_metric([arm], float((stats.get("per_user") or {}).get("users", 0)))
    yield from (rate, outcomes, accepts, users)
    if analysis.get("sample_ratio_e") is not None:
        srm = GaugeMetricFamily("release_canary_sample_ratio_e_value",
                                "The live canary's e-value against 'its arms' users are the split the routing asked "
                                "for' (held for a person at 1/release.srm_alpha)")
        srm.add_metric([], float(analysis["sample_ratio_e"]))
        yield srm


__all__ = ["ControllerMetrics", "StoreCollector"]
