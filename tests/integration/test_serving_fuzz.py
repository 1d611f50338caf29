"""Fuzz the serving API from its own published schema: no input may get a 5xx.

Schemathesis reads ``/openapi.json`` from a real app on the session's shared engine
(tests/conftest.py) and sends each operation bodies generated from the schema: valid ones
(``positive``) and ones that break it (``negative``: wrong types, missing fields, unknown names).
Every answer must be below 500; every 4xx must carry an OpenAI-style error message; and every
answer must match what the schema declares for it (status code, content type, JSON body, each
event of a stream), so the published schema is checked against the app's real responses too.
Random bodies rarely reach every response shape (a streamed chat answer with logprobs, say), so
``test_every_response_shape_matches_the_schema`` sends one request of each and runs the same
checks on the answers. The first version of this test found a 500: a ``top_k`` past 64 bits
broke the engine's request encoding (now bounded in the request model).

Bounded to keep the file within about a minute on the 2-core machine, most of it the engine's
start when no other serving test started it: 100 examples per operation and mode, the same ones
every run (a CI test must not flake on an input it never saw before; raise ``MAX_EXAMPLES`` to
explore further), and a deployment limit of 4 sampled tokens and 2 choices, which the schema
publishes, so generated bodies stay cheap while still reaching the engine. Run with::

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_serving_fuzz.py
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving_helpers import KEY

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 100  # per operation and generation mode
AUTH = {"Authorization": f"Bearer {KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /v1/feedback",
              "GET /health", "GET /metrics"}


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
