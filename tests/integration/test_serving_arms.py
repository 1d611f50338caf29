"""Arms users cannot see or steer, through the real app on the shared engine (issue 45).

- Feedback belongs to the answer's user: feedback that names another user than the one a
  generation was made for is refused (409), or with ``serve.feedback_other_user = "record"``
  recorded marked ``other_user``, which ingest never counts; feedback naming no user is the
  generation's user's (``user_id`` null on the record).
- A product key is never told which version answered (``"model": "flywheel"``, in answers,
  stream chunks, ``/v1/models``, ``/health`` and errors); a key in ``serve.version_visible_keys``
  is, and so is a request that pinned its version. The records keep the version either way.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serving_helpers import KEY, SALT, generations

from flywheel.contracts import FeedbackEvent, decode
from serving.identity import pseudonymise
from tests.conftest import read_all

pytestmark = pytest.mark.integration

PRODUCT = "sk-product"  # a product's key: not in serve.version_visible_keys (the fixture lists KEY)
EVAL = "sk-evaluation"  # an evaluation key: in serve.pin_api_keys, not told versions otherwise


def _generate(s, user: str | None, key: str = PRODUCT, **extra) -> dict:
    body = {"model": "flywheel", "prompt": "rate me", "max_tokens": 1, **extra}
    if user is not None:
        body["user"] = user
    r = s.post("/v1/completions", body, key=key)
    assert r.status_code == 200, r.text
    return r.json()


def _feedback(s, fid: str, gid: str, user: str | None, **kw) -> httpx.Response:
    body = {"feedback_id": fid, "generation_id": gid, "signal": "accept"}
    if user is not None:
        body["user"] = user
    return s.post("/v1/feedback", body, key=PRODUCT, **kw)


def test_feedback_naming_another_user_than_the_answers_is_refused(serve, broker):
    """The audit's attack: one requester's answers accepted under 60 other user ids made the
    latest feedback's user the rater, each a new user to the canary (false PASS 0.80)."""
    s = serve(api_keys=(KEY, PRODUCT))
    gen = _generate(s, "alice")["id"]
    refused = _feedback(s, "fb-bob", gen, "bob")
    assert refused.status_code == 409, refused.text
    err = refused.json()["error"]
    assert err["code"] == "feedback_user_mismatch" and err["param"] == "user"
    # it names the mismatch, never a user: not the raw ids, not their pseudonyms
    assert all(who not in err["message"] for who in ("alice", "bob", pseudonymise(SALT, "alice"),
                                                      pseudonymise(SALT, "bob")))
    header = _feedback(s, "fb-bob-header", gen, None, headers={"X-Flywheel-User": "bob"})
    assert header.status_code == 409, header.text  # named by the header, the same rule
    assert _feedback(s, "fb-alice", gen, "alice").status_code == 202
    assert _feedback(s, "fb-none", gen, None).status_code == 202  # names no one: the answer's user's
    # an id serving did not make (no owner tag): whose it is cannot be told, so it counts as the
    # generation's user's and the user it names is not recorded
    assert _feedback(s, "fb-untagged", "no-such-generation", "bob").status_code == 202
    events = {e.feedback_id: e for e in (decode(FeedbackEvent, r.value)
                                         for r in read_all(broker.bootstrap, s.topics.feedback, expect=3))}
    assert set(events) == {"fb-alice", "fb-none", "fb-untagged"}
    assert events["fb-alice"].user_id == pseudonymise(SALT, "alice")
    assert events["fb-none"].user_id is None and events["fb-untagged"].user_id is None
    assert not any(e.other_user for e in events.values())
    metrics = httpx.get(s.url + "/metrics").text
    assert 'serving_feedback_other_user_total{action="refused"} 2.0' in metrics


def test_feedback_of_another_user_can_be_recorded_marked_never_as_theirs(serve, broker):
    s = serve(api_keys=(KEY, PRODUCT), feedback_other_user="record")
    answer = _generate(s, None, n=2)  # no user: the key's; choices carry the response's owner tag
    gids = [c["generation_id"] for c in answer["choices"]]
    assert _feedback(s, "fb-carol", gids[1], "carol").status_code == 202
    assert _feedback(s, "fb-key", gids[0], PRODUCT).status_code == 202  # the user the answer was made for
    events = {e.feedback_id: e for e in (decode(FeedbackEvent, r.value)
                                         for r in read_all(broker.bootstrap, s.topics.feedback, expect=2))}
    carol = events["fb-carol"]
    assert carol.other_user and carol.user_id == pseudonymise(SALT, "carol")  # kept for audit, marked
    assert not events["fb-key"].other_user and events["fb-key"].user_id == pseudonymise(SALT, PRODUCT)
    metrics = httpx.get(s.url + "/metrics").text
    assert 'serving_feedback_other_user_total{action="recorded"} 1.0' in metrics


def test_a_product_key_is_not_told_which_version_answered(serve, broker):
    s = serve(api_keys=(KEY, PRODUCT, EVAL), pin_api_keys=(EVAL,))
    plain = _generate(s, "u1")
    assert plain["model"] == "flywheel"
    chunks = []
    with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {PRODUCT}"},
                      json={"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "user": "u2", "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"flywheel"}
    assert "usage" in chunks[-1]
    seen = s.post("/v1/completions", {"model": "flywheel", "prompt": "x", "max_tokens": 1, "user": "u3"}, key=KEY)
    assert seen.json()["model"] == "flywheel@v0"  # a key in serve.version_visible_keys
    # a product key may not pin: a pinned answer beside a routed one (same seed) tells the arm,
    # a 404 against a 200 which versions are loaded
    for version in ("flywheel@v0", "flywheel@v9"):
        refused = s.post("/v1/completions", {"model": version, "prompt": "x", "max_tokens": 1}, key=PRODUCT)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "pin_not_allowed"
    pinned = s.post("/v1/completions", {"model": "flywheel@v0", "prompt": "x", "max_tokens": 1}, key=EVAL)
    assert pinned.json()["model"] == "flywheel@v0"  # named by the request itself
    missing = s.post("/v1/completions", {"model": "flywheel@v9", "prompt": "x", "max_tokens": 1}, key=EVAL)
    assert missing.status_code == 404 and "@v0" not in missing.text and "stable" not in missing.text
    auth = {"Authorization": f"Bearer {PRODUCT}"}
    models = httpx.get(s.url + "/v1/models", headers=auth).json()["data"]
    assert models == [{"id": "flywheel", "object": "model", "created": 0, "owned_by": "flywheel"}]
    assert httpx.get(s.url + "/health", headers=auth).json() == {"ok": True}
    visible = httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [m["id"] for m in visible] == ["flywheel", "flywheel@v0"]
    # which version answered stays on every record, whatever the answer said
    events = generations(broker, s, expect=4)
    assert {e.model_version for e in events.values()} == {0}
    assert sorted(e.route for e in events.values()) == ["pinned", "stable", "stable", "stable"]
