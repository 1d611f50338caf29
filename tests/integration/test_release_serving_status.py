"""The release controller acts on what serving reports: real broker, the real release follower on
the session's vLLM engine, the real controller ticked by the test.

Serving runs one engine (``serve.engines=1``), so it refuses every canary (``no_canary_engine``),
and the versions announced here are forged: their manifest is not the one the announcement names,
so serving's fetch refuses them (``manifest_mismatch``). Serving reports both on
``flywheel.serving-status``, and the controller

- rolls the refused canary back within a turn of reading the report, serving's reason in its audit log;
- takes back a promotion serving refused, so its stable is again the version serving serves.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from flywheel.checkpoints import MANIFEST_NAME
from flywheel.contracts import ServingStatusEvent, decode
from flywheel.metrics import new_registry
from flywheel.settings import ReleaseSettings, Settings
from release.controller import Controller
from release.decisions import DecisionCounter
from release.states import State
from release.store import ReleaseStore, Routing
from release.streams import Streams
from tests.conftest import read_all

pytestmark = pytest.mark.integration


def forged_version(root: Path, version: int) -> dict:
    """The announcement of a version whose manifest is not the one it names (the checkpoint
    event a forger, or a store that lost the bytes, would leave)."""
    where = root / f"v{version}"
    where.mkdir(parents=True)
    (where / MANIFEST_NAME).write_text('{"files": {}}')
    return {"kind": "checkpoint", "version": version, "parent": None, "step": version, "uri": str(where),
            "manifest_sha256": hashlib.sha256(b"some other manifest").hexdigest(), "dtype": "float32",
            "full_snapshot": True, "samples": 8, "metrics": {}, "created_at": time.time()}


def wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def statuses(broker, topics, expect: int) -> list[ServingStatusEvent]:
    return [decode(ServingStatusEvent, r.value) for r in read_all(broker.bootstrap, topics.serving_status, expect=expect)]


@pytest.fixture
def rig(engine, broker, kafka_settings, topics, tiny_model_dir, tmp_path):
    from serving.follow import ReleaseFollower
    from serving.versions import Fleet

    loop, first = engine
    settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path, topic_prefix=topics.prefix, kafka=kafka_settings,
                        release=ReleaseSettings(database_url=f"sqlite:///{tmp_path / 'release.sqlite3'}",
                                                tick_s=0.1, lease_ttl_s=5, deadline_s=600))
    follower = ReleaseFollower(settings, Fleet([first]), lambda fn: loop.call(fn, timeout_s=300), new_registry())
    follower.catch_up(20)
    follower.start()
    registry = new_registry()
    controller = Controller(settings, ReleaseStore(settings.release.database_url), Streams(settings, registry),
                            None, registry)
    controller.store.listeners.append(DecisionCounter(registry))  # as release/main.py does
    person = ReleaseStore(settings.release.database_url)  # a person's, as the API's: not fenced
    controller.tick()  # takes the lease, hears nothing yet, and announces revision 0 (nothing decided yet)
    assert controller.active
    wait_for(lambda: follower.applied is not None and follower.applied.revision == 0, "serving to apply revision 0")
    yield controller, follower, person, registry
    follower.stop()
    controller.streams.close()
    controller.store.close()
    person.close()


def refusals(registry, action: str) -> float:
    return registry.get_sample_value("release_serving_refusals_total", {"action": action})


def decisions(registry, outcome: str) -> float | None:
    return registry.get_sample_value("release_decisions_total", {"outcome": outcome, "actor_kind": "controller"})


def test_a_canary_serving_refuses_is_rolled_back_within_a_turn_with_servings_reason(rig, broker, topics, tmp_path):
    controller, follower, person, registry = rig
    person.add_candidate(forged_version(tmp_path / "store", 1), "test")
    person.transition(1, State.GATING, "test", "gate")
    person.transition(1, State.CANARY, "test", "gate passed", None, Routing(0, 1, 0.5))
    controller.tick()  # publishes the canary's routing
    wait_for(lambda: follower.last_refusal is not None, "serving to refuse the canary")
    assert follower.last_refusal["reason"] == "no_canary_engine" and follower.fleet.served_versions() == {"stable": 0}
    [_, report] = statuses(broker, topics, expect=2)  # after revision 0's, applied at the start
    assert (report.outcome, report.revision, report.canary_version, report.serving_stable_version) == ("refused", 1, 1, 0)

    turns = 0
    while person.get(1).state != State.ROLLED_BACK and turns < 2:
        controller.tick()
        turns += 1
    assert person.get(1).state == State.ROLLED_BACK, f"still {person.get(1).state} after {turns} turns"
    why = person.audit(1)[0]
    assert why.to_state == "rolled_back" and "refused revision 1" in why.reason and "no_canary_engine" in why.reason
    assert why.evidence["serving_refused"]["instance"] == follower.instance
    assert refusals(registry, "rolled_back") == 1 and decisions(registry, "rolled_back") == 1
    rev = person.latest_revision()
    assert (rev.revision, rev.stable_version, rev.canary_version, rev.published) == (2, 0, None, True)

    # serving applies the rollback and says so; the controller hears it and acts no more
    wait_for(lambda: follower.applied is not None and follower.applied.revision == 2, "serving to apply revision 2")
    assert [(s.revision, s.outcome) for s in statuses(broker, topics, expect=3)] == [
        (0, "applied"), (1, "refused"), (2, "applied")]
    controller.tick()
    controller.tick()
    assert registry.get_sample_value("release_serving_revision_applied") == 2
    assert person.latest_revision().revision == 2 and refusals(registry, "rolled_back") == 1


def test_a_forged_version_promoted_is_refused_and_stable_stays_what_serving_serves(rig, broker, topics, tmp_path):
    controller, follower, person, registry = rig
    person.add_candidate(forged_version(tmp_path / "store", 1), "test")
    person.transition(1, State.GATING, "test", "gate")
    person.transition(1, State.CANARY, "test", "gate passed")  # (no canary routing: serving runs one engine)
    person.transition(1, State.AWAITING_APPROVAL, "test", "analysis passed")
    person.transition(1, State.PROMOTED, "test", "approved", None, Routing(1, None, 0.0))
    controller.tick()  # publishes stable v1
    wait_for(lambda: follower.last_refusal is not None, "serving to refuse version 1")
    assert follower.last_refusal["reason"] == "manifest_mismatch" and follower.fleet.served_versions() == {"stable": 0}
    statuses(broker, topics, expect=2)  # revision 0's report, then the refusal's

    turns = 0
    while controller.store.stable_version() != 0 and turns < 2:
        controller.tick()
        turns += 1
    assert controller.store.stable_version() == 0, f"stable still v{controller.store.stable_version()} after {turns} turns"
    entry = person.audit(1)[0]
    assert "manifest_mismatch" in entry.reason and "stable stays v0" in entry.reason
    assert entry.evidence["serving_refused"]["stable_version"] == 1
    assert refusals(registry, "stable_kept") == 1 and decisions(registry, "serving_refused") == 1
    # the new routing reaches serving, which already serves it: applied, and nothing more happens
    wait_for(lambda: follower.applied is not None and follower.applied.revision == 2, "serving to apply revision 2")
    controller.tick()
    assert person.latest_revision().revision == 2 and refusals(registry, "stable_kept") == 1
