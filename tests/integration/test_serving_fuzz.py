"""Fuzz the serving API from its own published schema: no input may get a 5xx.

Schemathesis reads ``/openapi.json`` from a real app on the session's shared engine
(tests/conftest.py) and sends each operation bodies generated from the schema: valid ones
(``positive``) and ones that break it (``negative``: wrong types, missing fields, unknown names).
Every answer must be below 500; every 4xx must carry an OpenAI-style error message; every answer
must match what the schema declares for it (status code, content type, JSON body, each event of a
stream, the headers it documents), so the published schema is checked against the app's real
responses too; and a body that breaks the schema must be refused, never answered as valid.
Random bodies rarely reach every response shape (a streamed chat answer with logprobs, say), so
``test_every_response_shape_matches_the_schema`` sends one request of each and runs the same
checks on the answers, and ``test_every_documented_answer_is_given_and_matches_the_schema`` provokes
each documented error once. The first version of this test found a 500: a ``top_k`` past 64 bits
broke the engine's request encoding (now bounded in the request model).

Bounded to keep the file within about a minute on the 2-core machine, most of it the engine's
start when no other serving test started it: 100 examples per operation and mode, the same ones
every run (a CI test must not flake on an input it never saw before; raise ``MAX_EXAMPLES`` to
explore further), and a deployment limit of 4 sampled tokens and 2 choices, which the schema
publishes, so generated bodies stay cheap while still reaching the engine. Run with::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_serving_fuzz.py
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving_helpers import KEY, Served

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 50  # per operation and generation mode (100 took 15 s of the default suite; derandomized)
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
               response_headers_conformance]
#: and a body that breaks the schema is refused (4xx), never answered as if it were valid
CHECKS = [*CONFORMANCE, negative_data_rejection]
OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /v1/feedback",
              "GET /livez", "GET /readyz", "GET /health", "GET /metrics"}


@pytest.fixture
def api_schema(serve):
    s = serve(max_tokens_limit=4, max_n=2, rate_limit_per_minute=10**6, rate_limit_burst=10**6,
              rate_limit_key_per_minute=10**6, rate_limit_key_burst=10**6)
    # an empty config: no schemathesis.toml is looked for up the tree
    return schemathesis.openapi.from_url(s.url + "/openapi.json", config=SchemathesisConfig.from_dict({}))


# Hypothesis driven directly (not schemathesis' pytest plugin, whose lazy ``from_fixture`` schemas
# need a pytest internal that pytest 9 removed): each operation's strategy, a bounded number of
# examples, no example database written into the work tree.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_5xx(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.label for op in operations} == OPERATIONS  # a new route is fuzzed too, or this fails
    for op in operations:
        if mode == GenerationMode.NEGATIVE and not op.body:
            continue  # nothing an input-less GET could get wrong
        fuzz(op, mode)


def fuzz(operation, mode: GenerationMode) -> None:
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case):
        response = case.call(headers=AUTH, timeout=60)
        what = f"{case.method} {case.path} {case.body!r}"
        assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], f"{what}: {response.text}"
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    one()


SHAPES = [
    ("/v1/completions", {"prompt": "the river", "logprobs": 2}),
    ("/v1/completions", {"prompt": [10, 11, 12], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_every_response_shape_matches_the_schema(api_schema, stream):
    for path, body in SHAPES:
        case = api_schema[path]["POST"].Case(
            body={"model": "flywheel", "max_tokens": 3, "stream": stream,
                  "stream_options": {"include_usage": stream}, **body},
            media_type="application/json")
        response = case.call(headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")
        case.validate_response(response, checks=CHECKS, headers=AUTH)
    # and what is refused is documented as refused
    case = api_schema["/v1/completions"]["POST"].Case(body={"model": "flywheel", "prompt": "x", "echo": True},
                                                      media_type="application/json")
    response = case.call(headers=AUTH, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    case.validate_response(response, checks=CHECKS, headers=AUTH)


def test_every_documented_answer_is_given_and_matches_the_schema(serve):
    """One request per status the schema documents for the generation routes, each answer checked
    against it: the error body ``{"error": {...}}`` of 400, 401, 403, 404, 413 and 429 (no 422:
    the app answers a body that fails validation with a 400, and documents none), the headers a
    401 (``WWW-Authenticate``) and a 429 (``Retry-After``) must carry, and ``/health`` with and
    without a key."""
    s: Served = serve(api_keys=(KEY, "sk-no-pin"), pin_api_keys=(KEY,), max_body_bytes=4096,
                      rate_limit_burst=1, rate_limit_per_minute=1)
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json", config=SchemathesisConfig.from_dict({}))
    raw = schema.raw_schema
    documented = {code for ops in raw["paths"].values() for op in ops.values() for code in op["responses"]}
    assert "422" not in documented
    for ops in raw["paths"].values():  # every answer has a body schema (an error's: ErrorResponse)
        for op in ops.values():
            assert all(r.get("content") for r in op["responses"].values()), op["operationId"]
    op = schema["/v1/completions"]["POST"]
    ok = {"model": "flywheel", "prompt": "x", "max_tokens": 1}
    sent = {
        400: (AUTH, b"{not json"),
        401: ({}, ok),
        403: ({"Authorization": "Bearer sk-no-pin"}, {**ok, "model": "flywheel@v0", "user": "u403"}),
        404: (AUTH, {**ok, "model": "elsewhere", "user": "u404"}),
        413: (AUTH, {**ok, "prompt": "x" * 5000}),
        200: (AUTH, {**ok, "user": "u429"}),
        429: (AUTH, {**ok, "user": "u429"}),
    }
    for status, (headers, body) in sent.items():
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(s.url + "/v1/completions", headers={**headers, "Content-Type": "application/json"},
                              timeout=60, **kw)
        assert response.status_code == status, (status, response.text)
        documented = raw["paths"]["/v1/completions"]["post"]["responses"][str(status)]
        for header in {401: ["WWW-Authenticate"], 429: ["Retry-After"]}.get(status, []):
            assert documented["headers"][header]["required"] and response.headers[header], (status, header)
        op.Case(media_type="application/json").validate_response(response, checks=CONFORMANCE, headers=headers)
    health = schema["/health"]["GET"]
    for headers, keys in (({}, {"ok"}), (AUTH, {"ok", "engines", "versions", "publisher", "last_error"})):
        response = httpx.get(s.url + "/health", headers=headers, timeout=60)
        assert response.status_code == 200 and keys <= set(response.json())
        assert headers or set(response.json()) == {"ok"}  # nothing else without a key
        health.Case().validate_response(response, checks=CONFORMANCE, headers=headers)

