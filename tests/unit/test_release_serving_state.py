"""What the controller does about serving's reports (release/serving_state.py): one row per rule,
and the contract of the report itself."""

from __future__ import annotations

import json

import pytest

from flywheel.contracts import ContractError, ServingStatusEvent, decode, encode
from release.serving_state import Act, respond
from release.store import Revision


def status(outcome: str = "refused", revision: int = 5, stable: int = 2, canary: int | None = 3,
           serving_stable: int = 2, refused: int | None = 3, reason: str = "manifest_mismatch") -> ServingStatusEvent:
    return ServingStatusEvent(deployment="flywheel", instance="pod-a:7", revision=revision, outcome=outcome,
                              stable_version=stable, canary_version=canary, serving_stable_version=serving_stable,
                              refused_version=refused if outcome == "refused" else None,
                              reason=reason if outcome == "refused" else "", detail="the files do not match", at=1.0)


def rev(revision: int, stable: int, canary: int | None = None) -> Revision:
    return Revision(revision, stable, canary, 0.1 if canary else 0.0, "", 1.0, True)


def ever_stable(*versions: int):
    return lambda v: v in versions


# (status, live canary, latest routing, versions ever stable) -> what the controller does
ROWS = [
    pytest.param(status(), 3, rev(5, 2, 3), (2,), Act.ROLL_BACK_CANARY, 3, id="refused canary still live: rolled back"),
    pytest.param(status(revision=5), 3, rev(6, 2, 3), (2,), Act.ROLL_BACK_CANARY, 3,
                 id="refused canary, a later revision of the same canary: rolled back"),
    pytest.param(status(), None, rev(6, 2), (2,), Act.NOTHING, None, id="canary already ended: nothing"),
    pytest.param(status(), 4, rev(7, 2, 4), (2,), Act.NOTHING, None, id="another canary live now: nothing"),
    pytest.param(status(outcome="applied"), 3, rev(5, 2, 3), (2,), Act.NOTHING, None, id="applied: nothing"),
    pytest.param(status(revision=6, stable=3, canary=None, refused=3), None, rev(6, 3), (2, 3), Act.KEEP_SERVING_STABLE, 2,
                 id="refused promotion, still the newest routing: stable stays what serving serves"),
    pytest.param(status(revision=6, stable=3, canary=None, serving_stable=0), None, rev(6, 3), (3,),
                 Act.KEEP_SERVING_STABLE, 0, id="refused promotion over the model directory: back to version 0"),
    pytest.param(status(revision=6, stable=3, canary=None), None, rev(7, 3), (2, 3), Act.NOTHING, None,
                 id="refused promotion overtaken by a newer routing: nothing"),
    pytest.param(status(revision=6, stable=3, canary=None), None, rev(7, 3, 4), (2, 3), Act.NOTHING, None,
                 id="a canary started since: nothing"),
    pytest.param(status(revision=6, stable=3, canary=None, serving_stable=9), None, rev(6, 3), (2, 3), Act.NOTHING, None,
                 id="serving names a version never stable here (a forged report): nothing"),
    pytest.param(status(revision=6, stable=2, canary=None, serving_stable=2, refused=2), None, rev(6, 2), (2,),
                 Act.NOTHING, None, id="refused a routing to the stable it serves: nothing to take back"),
    pytest.param(status(), None, None, (), Act.NOTHING, None, id="no routing decided: nothing"),
]


@pytest.mark.parametrize("report, live, latest, stable, act, version", ROWS)
def test_what_the_controller_does_about_a_report(report, live, latest, stable, act, version):
    got = respond(report, live, latest, ever_stable(*stable))
    assert (got.act, got.version) == (act, version)
    if got.act != Act.NOTHING:  # serving's own words reach the audit log
        assert "refused revision" in got.reason and report.reason in got.reason and report.detail in got.reason


def test_the_report_round_trips_and_a_refusal_must_say_why():
    s = status()
    assert decode(ServingStatusEvent, encode(s)) == s
    raw = json.loads(encode(s))
    for change in ({"reason": ""}, {"refused_version": None}, {"outcome": "applied"}, {"outcome": "kept"}):
        with pytest.raises(ContractError) as info:
            decode(ServingStatusEvent, json.dumps({**raw, **change}).encode())
        assert info.value.reason == "invalid"
