"""``flywheel usage`` adds up to the tokens served: a real serving app on the session's shared vLLM
engine answers requests under two API keys, records them on a real broker, the real ingest stage
(on a thread of this process) joins and archives them, and ``flywheel usage`` read from that
archive gives, per key id and version, what the responses' own ``usage`` said and what serving's
counters counted (with ``serve.metrics_key_ids``; without it ``/metrics`` names no key id). A
generation written before records carried the key (no ``api_key_id``) is archived and counted
under no key. The trainer's side is held by
tests/integration/test_trainer_store.py (``flywheel usage`` against real DeepSpeed versions).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import closing

import httpx
import pytest
from conftest import running, small_generation, stage_settings
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import KEY, SALT

from cli.main import main
from cli.usage import served
from flywheel.contracts import encode
from flywheel.kafka.clients import make_producer
from serving.identity import key_id

pytestmark = pytest.mark.integration

OTHER = "sk-test-other-product"
#: (key, route, body): one request with two choices (its prompt counts once), chat and completions
REQUESTS = [
    (KEY, "/v1/completions", {"prompt": "the river runs", "max_tokens": 5, "n": 2, "user": "u1"}),
    (KEY, "/v1/completions", {"prompt": "a long way to the sea and back again", "max_tokens": 7, "user": "u2"}),
    (OTHER, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
                                     "user": "u3"}),
    (OTHER, "/v1/completions", {"prompt": "three ways", "max_tokens": 3, "n": 3, "user": "u4"}),
]
GENERATIONS = 2 + 1 + 1 + 3 + 1  # and the one recorded before keys were


def _counters(url: str) -> dict[tuple[str, str, str], float]:
    """serving's token counters: {(metric, api_key, model_version): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, s.labels["api_key"], s.labels["model_version"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("serving_prompt_tokens_total", "serving_completion_tokens_total")}


def test_usage_adds_up_to_the_tokens_served(serve, kafka_settings, topics, tmp_path, capsys):
    from ingest.main import run as run_ingest

    # both keys are told which version answered: the test adds up usage by version
    app = serve(prefix=topics.prefix, api_keys=(KEY, OTHER), version_visible_keys=(KEY, OTHER), metrics_key_ids=True)
    want: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for key, route, body in REQUESTS:
        r = app.post(route, {"model": "flywheel", **body}, key=key)
        assert r.status_code == 200, r.text
        usage, kid = r.json()["usage"], key_id(SALT, key)
        assert r.json()["model"] == "flywheel@v0"
        want[kid]["requests"] += 1
        want[kid]["generations"] += len(r.json()["choices"])
        want[kid]["prompt_tokens"] += usage["prompt_tokens"]
        want[kid]["completion_tokens"] += usage["completion_tokens"]
    legacy = json.loads(encode(small_generation("before-keys", time.time())))
    assert "api_key_id" not in legacy or legacy.pop("api_key_id") is None
    want[None] = {"requests": 1, "generations": 1, "prompt_tokens": 2, "completion_tokens": 2}

    ingest_dir = tmp_path / "ingest"
    archive = ingest_dir / "archive" / "episodes"
    settings = stage_settings(kafka_settings, topics, ingest_dir, FLYWHEEL_INGEST_WINDOW_S="1",
                              FLYWHEEL_INGEST_GRACE_S="0")
    with closing(make_producer(kafka_settings, "test")) as producer, running(run_ingest, settings):
        producer.send(topics.generations, key="before-keys", value=json.dumps(legacy).encode())
        producer.flush()
        deadline = time.monotonic() + 120  # each episode leaves when its 1 s window closes
        while sum(r.generations for r in served([archive], 0.0)) < GENERATIONS:
            assert time.monotonic() < deadline, f"archived so far: {served([archive], 0.0)}"
            time.sleep(0.5)

    assert main(["usage", "--archive", str(archive), "--checkpoints", str(tmp_path / "no-store"), "-o", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = {r["api_key"]: {k: r[k] for k in ("requests", "generations", "prompt_tokens", "completion_tokens")}
            for r in got["served"]}
    assert {r["version"] for r in got["served"]} == {0} and len(got["served"]) == 3
    assert rows == {k: dict(v) for k, v in want.items()}
    assert got["served_total"]["generations"] == GENERATIONS and got["trained"] == []
    assert KEY not in json.dumps(got) and OTHER not in json.dumps(got)  # ids, never the keys

    # serving's counters say the same for the requests it served
    counters = _counters(app.url)
    for kid in (key_id(SALT, KEY), key_id(SALT, OTHER)):
        assert counters[("serving_prompt_tokens_total", kid, "0")] == want[kid]["prompt_tokens"]
        assert counters[("serving_completion_tokens_total", kid, "0")] == want[kid]["completion_tokens"]

    assert main(["usage", "--archive", str(archive), "--checkpoints", str(tmp_path / "no-store")]) == 0
    table = capsys.readouterr().out
    lines = [line.split() for line in table.split("\n\n")[0].splitlines()[2:]]
    other = want[key_id(SALT, OTHER)]
    assert [key_id(SALT, OTHER), "v0", str(other["requests"]), str(other["generations"]), str(other["prompt_tokens"]),
            str(other["completion_tokens"])] in lines
    assert ["(none)", "v0", "1", "1", "2", "2"] in lines
    assert lines[-1][:3] == ["total", str(len(REQUESTS) + 1), str(GENERATIONS)]


def test_metrics_name_no_api_key_id_unless_a_setting_asks(serve, topics):
    """``/metrics`` answers without a key; an id there let anyone check guesses of the key against
    it (under the published salt, 10^4 guesses took 0.01 s). By default the counters keep their
    shape with ``api_key="all"``; ``flywheel usage`` reads ids from the archive instead."""
    app = serve(prefix=topics.prefix, api_keys=(KEY, OTHER))
    for key in (KEY, OTHER):
        r = app.post("/v1/completions", {"model": "flywheel", "prompt": "the river runs", "max_tokens": 3}, key=key)
        assert r.status_code == 200, r.text
    text = httpx.get(app.url + "/metrics", timeout=10).text
    assert key_id(SALT, KEY) not in text and key_id(SALT, OTHER) not in text and "key-" not in text
    counters = _counters(app.url)
    assert {k for _, k, _ in counters} == {"all"}
    assert counters[("serving_completion_tokens_total", "all", "0")] == 6
    assert "serving_api_keys_configured 2.0" in text  # what the signing alert asks: a deployment with keys
