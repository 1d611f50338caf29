"""Serving end to end: real vLLM engine, real broker, real HTTP on loopback, the official openai client.

One engine (about 25 s to start) is shared by the session's serving tests (tests/conftest.py);
each test gets its own app, recorder, journal and uuid topics on a fresh loopback port. Records
are checked on the topics with a real Kafka consumer.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from collections import Counter

import httpx
import openai
import pytest
from serving_helpers import KEY, SALT, generations

from flywheel.contracts import FeedbackEvent, GenerationEvent, Topics, decode, encode
from flywheel.settings import ServeSettings, Settings
from serving.identity import pseudonymise
from serving.journal import Journal
from tests.conftest import read_all

pytestmark = pytest.mark.integration


def check_event(ev: GenerationEvent, model: str, text: str, group: str, endpoint: str) -> None:
    assert f"flywheel@v{ev.model_version}" == model
    assert ev.group_id == group and ev.endpoint == endpoint
    assert ev.completion_text == text
    assert len(ev.logprobs) == len(ev.completion_token_ids) > 0
    assert all(lp <= 0.0 for lp in ev.logprobs)
    assert ev.sampling.logprobs_mode == "processed"
    assert ev.finish_reason in ("stop", "length")
    assert ev.completed_at >= ev.created_at and ev.latency_ms > 0


def test_completions_and_chat_are_recorded_exactly_once(serve, broker, engine):
    s = serve()
    tok = engine[1].tokenizer
    expected: dict[str, tuple[str, str, str, str]] = {}  # gen id -> (model, text, group, endpoint)

    r = s.client.completions.create(model="flywheel", prompt="the model is", max_tokens=6,
                                    temperature=0.7, user="alice")
    assert r.id == r.choices[0].generation_id  # n == 1: the response id is the generation id
    expected[r.id] = (r.model, r.choices[0].text, r.id, "completions")

    r = s.client.completions.create(model="flywheel", prompt="a list of data", max_tokens=5, n=3, seed=7,
                                    stop=["never-sampled"])  # stop strings: vLLM detokenizes
    assert [c.generation_id for c in r.choices] == [f"{r.id}-{i}" for i in range(3)]
    for c in r.choices:
        expected[c.generation_id] = (r.model, c.text, r.id, "completions")

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = s.client.chat.completions.create(model="flywheel", messages=messages, max_tokens=7)
    expected[r.id] = (r.model, r.choices[0].message.content, r.id, "chat")
    chat_id = r.id

    texts: dict[str, list[str]] = {}
    model = group = ""
    for chunk in s.client.completions.create(model="flywheel", prompt="stream me", max_tokens=6, stream=True):
        model, group = chunk.model, chunk.id
        for c in chunk.choices:
            texts.setdefault(c.generation_id, []).append(c.text)
    for chunk in s.client.chat.completions.create(model="flywheel", messages=messages, max_tokens=5,
                                                  n=2, stream=True):
        for c in chunk.choices:
            texts.setdefault(c.generation_id, []).append(c.delta.content or "")
            expected.setdefault(c.generation_id, (chunk.model, "", chunk.id, "chat"))
    for gid, parts in texts.items():
        m, _, g, endpoint = expected.get(gid, (model, "", group, "completions"))
        expected[gid] = (m, "".join(parts), g, endpoint)

    events = generations(broker, s, expect=len(expected))
    assert set(events) == set(expected)  # every choice exactly once, nothing else
    for gid, (m, text, g, endpoint) in expected.items():
        check_event(events[gid], m, text, g, endpoint)
    first = next(iter(expected))
    assert events[first].user_id == pseudonymise(SALT, "alice")
    assert events[first].sampling.temperature == 0.7
    # the chat prompt is the chat template's rendering, and its ids are exactly what was sent
    chat = events[chat_id]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_text == rendered and rendered.endswith("<|assistant|>")
    assert list(chat.prompt_token_ids) == tok.encode(rendered, add_special_tokens=False)
    assert chat.user_id == pseudonymise(SALT, KEY)  # no user field or header: the key


def test_models_health_and_metrics(serve):
    s = serve()
    # the deployment (routed by user), then each version loaded, which a request may pin
    assert [m.id for m in s.client.models.list().data] == ["flywheel", "flywheel@v0"]
    s.client.completions.create(model="flywheel", prompt="count my tokens", max_tokens=4)
    health = httpx.get(s.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert health["ok"] and health["engine"] == "ok" and health["journal_records"] == 0
    assert health["versions"] == {"stable": 0} and health["engines"][0]["in_flight"] == 0
    text = httpx.get(s.url + "/metrics").text
    assert 'serving_requests_total{model_version="0",route="/v1/completions",status="200"} 1.0' in text
    assert 'serving_generated_tokens_total{model_version="0"} 4.0' in text
    assert "serving_request_latency_seconds_count" in text and "serving_journal_depth_bytes" in text
    assert 'serving_routed_requests_total{route="stable"} 1.0' in text
    assert 'serving_route_version{route="stable"} 0.0' in text and 'serving_route_version{route="canary"} -1.0' in text


def test_feedback_is_recorded_once_per_post(serve, broker):
    s = serve()
    # bob's answer: feedback naming him is his (another user's is refused: test_serving_arms.py)
    gen = s.client.completions.create(model="flywheel", prompt="rate me", max_tokens=3, user="bob")
    bodies = [
        {"feedback_id": "fb-1", "generation_id": gen.id, "signal": "accept", "decision_ms": 850},
        {"feedback_id": "fb-2", "generation_id": gen.id, "signal": "edit", "edited_text": "better"},
        {"feedback_id": "fb-3", "generation_id": "no-such-generation", "signal": "reject"},
        {"feedback_id": "fb-1", "generation_id": gen.id, "signal": "accept"},  # a client retry
        # a client clock an hour ahead: the action cannot have come after its report
        {"feedback_id": "fb-4", "generation_id": gen.id, "signal": "reject", "created_at": time.time() + 3600},
    ]
    for body in bodies:
        r = s.post("/v1/feedback", body, headers={"X-Flywheel-User": "bob"})
        assert r.status_code == 202, r.text
        assert r.json()["id"] == body["feedback_id"]
    nan = s.post("/v1/feedback", json.dumps({"feedback_id": "fb-5", "generation_id": gen.id, "signal": "accept",
                                             "created_at": float("nan")}), headers={"Content-Type": "application/json"})
    assert nan.status_code == 400 and "created_at" in nan.json()["error"]["message"], nan.text
    lone = s.post("/v1/feedback", b'{"feedback_id": "fb-6", "generation_id": "g", "signal": "edit", '
                                  b'"edited_text": "\\ud800"}', headers={"Content-Type": "application/json"})
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"], lone.text
    events = [decode(FeedbackEvent, r.value) for r in read_all(broker.bootstrap, s.topics.feedback, expect=5)]
    assert Counter(e.feedback_id for e in events) == {"fb-1": 2, "fb-2": 1, "fb-3": 1, "fb-4": 1}
    ahead = next(e for e in events if e.feedback_id == "fb-4")
    assert ahead.created_at == ahead.received_at
    edit = next(e for e in events if e.feedback_id == "fb-2")
    assert edit.signal == "edit" and edit.edited_text == "better" and edit.user_id == pseudonymise(SALT, "bob")
    assert next(e for e in events if e.feedback_id == "fb-1").decision_ms == 850
    metrics = httpx.get(s.url + "/metrics").text
    assert 'serving_feedback_total{signal="accept"} 2.0' in metrics


def test_health_shows_internals_only_to_a_product_key(serve):
    """A probe needs to know whether to send traffic: ``{"ok": bool}``, with 200 or 503. Versions,
    engines, the publisher's last error (broker addresses), and the release follower's state (store
    URIs, refusals) are for callers with a product key; the release API does the same."""
    s = serve()
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic c2stdGVzdA=="}):
        r = httpx.get(s.url + "/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"ok": True}, headers
    full = httpx.get(s.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert full["ok"] and full["versions"] == {"stable": 0} and {"engines", "publisher", "last_error"} <= set(full)


def test_unknown_or_missing_key_gets_401(serve):
    s = serve()
    bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="flywheel", prompt="x", max_tokens=1)
    for key in (None, "sk-wrong"):
        r = s.post("/v1/feedback", {"feedback_id": "f", "generation_id": "g", "signal": "accept"}, key=key)
        assert r.status_code == 401
        assert "API key" in r.json()["error"]["message"]


def test_a_non_ascii_key_gets_401_not_500(serve):
    """A header's bytes beyond ASCII reach the app as latin-1 text, which hmac.compare_digest
    refused with a TypeError: a 500 and a traceback per request."""
    s = serve()
    for raw in ("sk-t\u00e9st".encode(), "\u043a\u043b\u044e\u0447".encode(), b"sk-\xff"):
        headers = {"Authorization": b"Bearer " + raw}
        for method, path, body in (("POST", "/v1/completions", {"model": "flywheel", "prompt": "x", "max_tokens": 1}),
                                   ("POST", "/v1/feedback", {"feedback_id": "f", "generation_id": "g", "signal": "accept"}),
                                   ("GET", "/v1/models", None)):
            r = httpx.request(method, s.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (raw, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"


def test_rotating_users_on_one_key_meets_the_key_limit(serve):
    """The user limit is keyed on what the client names (``user``, ``X-Flywheel-User``): with a
    user burst of 5, ten requests each naming a new user all went through. The key's own bucket
    (burst 8 here) stops them; another key is not affected."""
    s = serve(api_keys=(KEY, "sk-other"), rate_limit_burst=5, rate_limit_per_minute=1,
              rate_limit_key_burst=8, rate_limit_key_per_minute=1)
    body = {"model": "flywheel", "prompt": "hi", "max_tokens": 1}
    codes = [s.post("/v1/completions", {**body, "user": f"rotated-{i}"}).status_code for i in range(6)]
    codes += [s.post("/v1/completions", body, headers={"X-Flywheel-User": f"header-{i}"}).status_code for i in range(4)]
    assert codes == [200] * 8 + [429] * 2
    r = s.post("/v1/completions", {**body, "user": "yet-another"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error" and "API key" in r.json()["error"]["message"]
    assert s.post("/v1/completions", {**body, "user": "rotated-0"}, key="sk-other").status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(serve):
    """Tokenizing a 1 MiB chat prompt takes over a second here (4 MiB: several): on the event loop
    it stalled every other request, ``/health`` included, until it was done. Off the loop, probes
    keep being answered while it runs: many of them finish before the huge request does."""
    s = serve(max_body_bytes=8 << 20)
    words = "the quick brown fox jumps over the lazy dog " * 100_000  # 4.5 MB: ~2.8 M tokens
    body = {"model": "flywheel", "messages": [{"role": "user", "content": words}]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(s.post, "/v1/chat/completions", body)
        answered = 0
        while not big.done():
            r = httpx.get(s.url + "/health", timeout=300)
            assert r.status_code == 200
            answered += not big.done()
        resp = big.result()
    # the whole prompt was tokenized (its length is in the refusal), and probes went on meanwhile
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert answered >= 5, f"only {answered} /health answers while the prompt was tokenized"


def test_rate_limit_gives_429_with_retry_after_per_user(serve):
    # one token a minute: a slow machine must not refill the bucket between the requests below
    s = serve(rate_limit_burst=2, rate_limit_per_minute=1)
    body = {"model": "flywheel", "prompt": "hi", "max_tokens": 1, "user": "carol"}
    assert [s.post("/v1/completions", body).status_code for _ in range(2)] == [200, 200]
    r = s.post("/v1/completions", body)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
    assert s.post("/v1/completions", {**body, "user": "dave"}).status_code == 200  # others unaffected
    with pytest.raises(openai.RateLimitError):
        s.client.completions.create(model="flywheel", prompt="hi", max_tokens=1, user="carol")


def test_a_users_rate_limit_is_per_api_key(serve):
    """Key B's requests as user "victim" used to spend the one bucket "victim" had, and key A's
    next request as "victim" got 429: one product could throttle another's users by naming them.
    Now each key's "victim" has a bucket of its own."""
    s = serve(api_keys=(KEY, "sk-other"), rate_limit_burst=2, rate_limit_per_minute=1)
    body = {"model": "flywheel", "prompt": "hi", "max_tokens": 1, "user": "victim"}
    codes = [s.post("/v1/completions", body, key="sk-other").status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert [s.post("/v1/completions", body).status_code for _ in range(3)] == [200, 200, 429]


LONG = list(range(10, 500))  # 490 prompt ids: + 100 new tokens passes the 512-token context


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/v1/completions", b'{"model": "flywheel", "prompt": ', 400, "not valid JSON"),
        ("/v1/completions", {"model": "flywheel"}, 400, "prompt"),
        ("/v1/completions", {"model": "flywheel", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "flywheel", "prompt": "x", "max_tokens": 5000}, 400, "limit of 64"),
        ("/v1/completions", {"model": "flywheel", "prompt": "x", "n": 9}, 400, "limit of 4"),
        ("/v1/completions", {"model": "flywheel", "prompt": LONG, "max_tokens": 30}, 400, "maximum context length"),
        ("/v1/completions", {"model": "flywheel", "prompt": [1, 99999]}, 400, "token ids"),
        ("/v1/completions", {"model": "flywheel", "prompt": ""}, 400, "empty"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ("/v1/completions", {"model": "flywheel@latest", "prompt": "x"}, 404, "flywheel@v<version>"),
        ("/v1/completions", {"model": "flywheel@v7", "prompt": "x"}, 404, ("version 7 is not loaded; this "
                                                                         "deployment serves flywheel@v0 (stable)")),
        ("/v1/chat/completions", {"model": "flywheel", "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user"}]}, 400, "content"),
        ("/v1/feedback", {"feedback_id": "f", "generation_id": "g", "signal": "love"}, 400, "signal"),
        ("/v1/feedback", {"feedback_id": "f", "generation_id": "g", "signal": "edit"}, 400, "edited_text"),
        ("/v1/feedback", {"feedback_id": "f", "generation_id": "g"}, 400, "signal"),
        ("/v1/feedback", {"feedback_id": "f", "generation_id": "g", "signal": "accept", "decision_ms": -1}, 400, "decision_ms"),
        ("/v1/feedback", b"x" * 5000, 413, "exceeds the limit"),
        ("/v1/nope", {}, 404, "Not Found"),
    ],
)
def test_bad_input_gets_a_clear_4xx(serve, path, body, status, needle):
    s = serve(max_tokens_limit=64, max_n=4, max_body_bytes=4096)
    r = s.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_a_request_pins_a_loaded_version_only_with_a_key_allowed_to(serve, broker):
    s = serve(api_keys=(KEY, "sk-eval", "sk-product"), pin_api_keys=("sk-eval",))
    pinned = s.post("/v1/completions", {"model": "flywheel@v0", "prompt": "eval me", "max_tokens": 2}, key="sk-eval")
    assert pinned.status_code == 200 and pinned.json()["model"] == "flywheel@v0"
    refused = s.post("/v1/completions", {"model": "flywheel@v0", "prompt": "eval me", "max_tokens": 2},
                     key="sk-product")  # KEY sees versions (the fixture's version_visible_keys), so may pin
    assert refused.status_code == 403 and "may not pin" in refused.json()["error"]["message"]
    ev = generations(broker, s, expect=1)[pinned.json()["id"]]
    assert ev.route == "pinned" and ev.model_version == 0 and ev.version_spans == ()


def test_oversized_body_is_refused_without_content_length(serve):
    s = serve(max_body_bytes=4096)

    def chunks():  # chunked transfer: no Content-Length to check up front
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


def test_feedback_body_is_capped_below_what_ingest_accepts(serve):
    """A larger serve.max_body_bytes (for long prompts) must not let through feedback that ingest
    would dead-letter as oversized after the API had answered 202."""
    s = serve(max_body_bytes=4 << 20)
    text = "e" * (1 << 20)
    r = s.post("/v1/feedback", {"feedback_id": "big", "generation_id": "g", "signal": "edit", "edited_text": text})
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]


def test_broker_stall_loses_no_accepted_feedback(serve, broker):
    s = serve(ack_timeout_s=0.5)
    accepted: list[str] = []

    def send(i: int) -> None:
        r = s.post("/v1/feedback", {"feedback_id": f"stall-{i}", "generation_id": f"g{i}", "signal": "accept"})
        if r.status_code == 202:
            accepted.append(f"stall-{i}")

    for i in range(3):
        send(i)
    broker.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(3, 15)))
        stalled = httpx.get(s.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        public = httpx.get(s.url + "/health").json()  # what a probe (or anyone) sees meanwhile
        # a completion during the stall answers normally; its event waits in the journal
        gen = s.client.completions.create(model="flywheel", prompt="during the stall", max_tokens=3)
    finally:
        broker.resume()
    assert stalled["publisher"] == "degraded" and stalled["journal_records"] > 0
    assert public == {"ok": True}  # no broker address, no error text
    assert len(accepted) == 15
    records = read_all(broker.bootstrap, s.topics.feedback, expect=15, timeout_s=30)
    seen = Counter(decode(FeedbackEvent, r.value).feedback_id for r in records)
    assert set(seen) == set(accepted)  # every 202 is on the topic
    print(f"\nbroker stall: {len(accepted)} accepted, {sum(seen.values()) - len(seen)} duplicates")
    assert gen.id in generations(broker, s, expect=1)


def test_journal_from_a_previous_process_is_replayed_on_start(serve, broker, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}."
    topic = Topics(prefix).feedback
    left = Journal(tmp_path / "serving" / "journal", 1 << 20)  # what a crashed process left
    left.append([(topic, "g", encode(FeedbackEvent(feedback_id=f"old-{i}", generation_id="g", signal="reject",
                                                   created_at=1.0, received_at=1.0))) for i in range(5)])
    left.close()
    s = serve(prefix=prefix)
    assert s.post("/v1/feedback", {"feedback_id": "new", "generation_id": "g", "signal": "accept"}).status_code == 202
    records = read_all(broker.bootstrap, topic, expect=6)
    # same key -> same partition, so the topic order is the order serving accepted them
    assert [decode(FeedbackEvent, r.value).feedback_id for r in records] == [f"old-{i}" for i in range(5)] + ["new"]


def test_serve_refuses_weights_that_do_not_match_the_manifest(tiny_model_dir, tmp_path):
    import shutil

    from serving.main import run

    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    weights = next(bad.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert run(Settings(model_dir=bad, data_dir=tmp_path, routing_secret=SALT,
                    serve=ServeSettings(api_keys=("k",), user_id_salt=SALT))) == 2
    assert json.loads((bad / "flywheel-manifest.json").read_text())["version"] == 0


def test_recorded_logprobs_are_from_the_tempered_distribution(serve, broker):
    """Processed logprobs: at a low temperature the sampled tokens are near-certain under the
    distribution they were drawn from. The tiny random model's raw distribution is near uniform
    over ~512 tokens (log p about -6 whatever the temperature), so raw logprobs would barely move."""
    s = serve()
    cold = s.client.completions.create(model="flywheel", prompt="the river", max_tokens=16, temperature=0.05)
    warm = s.client.completions.create(model="flywheel", prompt="the river", max_tokens=16, temperature=1.0)
    events = generations(broker, s, expect=2)
    mean = {k: sum(events[r.id].logprobs) / len(events[r.id].logprobs) for k, r in (("cold", cold), ("warm", warm))}
    assert mean["warm"] < -4.0, mean
    assert mean["cold"] > mean["warm"] + 2.0, mean


def test_full_journal_during_a_stall_answers_503_not_silence(serve, broker):
    s = serve(ack_timeout_s=0.3, journal_max_bytes=4096)
    codes: dict[str, int] = {}
    broker.pause()
    try:
        for i in range(40):
            r = s.post("/v1/feedback", {"feedback_id": f"full-{i}", "generation_id": "g", "signal": "ignore"})
            codes[f"full-{i}"] = r.status_code
            if r.status_code == 503:
                assert "journal is full" in r.json()["error"]["message"]
                assert r.headers["Retry-After"]
                break
    finally:
        broker.resume()
    assert list(codes.values())[-1] == 503 and set(list(codes.values())[:-1]) == {202}
    accepted = {k for k, c in codes.items() if c == 202}
    records = read_all(broker.bootstrap, s.topics.feedback, expect=len(accepted), timeout_s=30)
    assert {decode(FeedbackEvent, r.value).feedback_id for r in records} == accepted


def test_client_that_disconnects_mid_stream_is_recorded_as_abort(serve, broker):
    s = serve()
    body = {"model": "flywheel", "prompt": "go on", "max_tokens": 500, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        first = next(r.iter_lines())
    gid = json.loads(first.removeprefix("data: "))["id"]
    ev = generations(broker, s, expect=1)[gid]
    assert ev.finish_reason == "abort"
    assert 0 < len(ev.completion_token_ids) < 500 and len(ev.logprobs) == len(ev.completion_token_ids)
