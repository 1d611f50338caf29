"""Serving's wait for a routing (serving/readiness.py ``judge_routing``) and the settings that bound
it: pure, table-tested."""

from __future__ import annotations

import pytest

from flywheel.settings import SettingsError, load_settings
from serving.readiness import RoutingState, judge_routing


@pytest.mark.parametrize("applied, waited_s, wait_s, state", [
    (True, 0.0, 120.0, RoutingState.APPLIED),  # a release applied: nothing to wait for
    (True, 500.0, 120.0, RoutingState.APPLIED),  # applied after the wait ran out: confirmed again
    (False, 0.0, 120.0, RoutingState.WAITING),  # a new pod, no record on the topic, none saved
    (False, 119.9, 120.0, RoutingState.WAITING),
    (False, 120.0, 120.0, RoutingState.UNCONFIRMED),  # the wait is over: the model directory, loudly
    (False, 0.0, 0.0, RoutingState.UNCONFIRMED),  # routing_wait_s=0: no wait at all
])
def test_judge_routing(applied, waited_s, wait_s, state):
    assert judge_routing(applied, waited_s, wait_s) is state


@pytest.mark.parametrize("wait, period, refused", [
    ("120", "60", False),  # the defaults: a wait outlasting a period and most of another
    ("0", "60", False),  # no wait: the model directory at once, marked unconfirmed
    ("60", "60", True),  # a pod started just after an announcement would stop waiting as the next is due
    ("30", "60", True),
    ("10", "5", False),
])
def test_a_routing_wait_no_longer_than_the_reannouncement_period_is_refused(wait, period, refused):
    env = {"FLYWHEEL_SERVE_ROUTING_WAIT_S": wait, "FLYWHEEL_RELEASE_REANNOUNCE_S": period}
    if refused:
        with pytest.raises(SettingsError, match="serve.routing_wait_s.*must be above release.reannounce_s"):
            load_settings(env=env)
    else:
        s = load_settings(env=env)
        assert (s.serve.routing_wait_s, s.release.reannounce_s) == (float(wait), float(period))
