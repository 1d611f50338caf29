"""``flywheel demo``: the system on one machine, driven by a scripted client session, then stop.

What it does, in order:

1. builds a small model in ``<data_dir>/model`` the first time (``flywheel model init``);
2. starts the embedded Kafka-protocol broker on a free loopback port and creates the topics;
3. starts ``flywheel serve`` as its own process, exactly as an operator would, with a fresh API key;
4. plays a short client session with the official ``openai`` client: completions, chat, streaming,
   and feedback (accept, reject, edit) on what came back;
5. reads the topics back and prints what was recorded;
6. starts ``flywheel ingest``, ``flywheel reward`` and ``flywheel train`` as processes, plays a
   synthetic user population with a hidden preference (users accept vowel-rich completions) in
   groups of samples per prompt, and shows the episodes, rewards and the first checkpoint the
   trainer publishes from them; then stops every process it started.

Short windows and intervals (a few seconds) are set here so the demo finishes in minutes; the
production defaults are in flywheel/settings.py.

It imports no stage code: stages are processes talking over the broker, as in production.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

import httpx

from flywheel.checkpoints import MANIFEST_NAME
from flywheel.contracts import (
    CheckpointEvent,
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    RewardEvent,
    Topics,
    decode,
)
from flywheel.kafka.clients import ensure_topics
from flywheel.settings import Settings
from local.broker import EmbeddedBroker, free_port

PROMPTS = (
    "Write a function that returns the first value",
    "Tell me about the river near the city",
    "Please list three colors",
)


def run(settings: Settings, args: argparse.Namespace) -> int:
    data_dir = Path(settings.data_dir)
    model_dir = ensure_model(Path(settings.model_dir))
    with ExitStack() as stack:
        broker = stack.enter_context(EmbeddedBroker())
        kafka = settings.kafka.model_copy(
            update={"bootstrap": broker.bootstrap, "session_timeout_ms": 2000, "heartbeat_interval_ms": 500}
        )
        topics = Topics(settings.topic_prefix)
        ensure_topics(kafka, topics.all())
        _say(f"broker on {broker.bootstrap}; topics: {', '.join(topics.all())}")
        key = "demo-" + secrets.token_hex(8)
        port = free_port()
        env = _stage_env(settings, kafka.bootstrap, data_dir, model_dir, key, port)
        serve = stack.enter_context(_process(["serve"], env, data_dir / "logs" / "serve.log"))
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, serve, timeout_s=300)
        _say(f"serving on {base} (model {model_dir})")
        generation_ids = _client_session(base, key)
        _say("reading back what serving recorded ...")
        _show_topics(kafka.bootstrap, topics, expect_generations=len(generation_ids))
        for role in ("ingest", "reward", "train"):
            stack.enter_context(_process([role], _pipeline_env(env), data_dir / "logs" / f"{role}.log"))
        _say("started ingest, reward and train; synthetic users are now using the product ...")
        judged = _synthetic_users(base, key, prompts=args.users)
        _show_pipeline(kafka.bootstrap, topics, judged, timeout_s=args.wait)
    _say("demo finished; every process it started has stopped")
    return 0


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    from flywheel.modelinit import ModelSpec, init_model

    _say(f"building a small model in {model_dir} (first run only)")
    return init_model(model_dir, ModelSpec())


def _stage_env(settings: Settings, bootstrap: str, data_dir: Path, model_dir: Path, key: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap,
        FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS="2000",
        FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS="500",
        FLYWHEEL_TOPIC_PREFIX=settings.topic_prefix,
        FLYWHEEL_DATA_DIR=str(data_dir),
        FLYWHEEL_MODEL_DIR=str(model_dir),
        FLYWHEEL_API_KEYS=key,
        FLYWHEEL_SERVE_PORT=str(port),
        # no release controller runs in this demo, so no canary: one engine, half the memory
        FLYWHEEL_SERVE_ENGINES="1",
        FLYWHEEL_LOG_LEVEL=settings.log_level,
    )
    return env


class _process:
    """A ``flywheel <role>`` child process, logging to a file, stopped with SIGTERM on exit."""

    def __init__(self, role: list[str], env: dict[str, str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("ab")
        cmd = [sys.executable, "-m", "cli", *role]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _pipeline_env(env: dict[str, str]) -> dict[str, str]:
    """Demo-sized windows and intervals so each stage acts within seconds."""
    return {
        **env,
        "FLYWHEEL_INGEST_WINDOW_S": "3",
        "FLYWHEEL_INGEST_ORPHAN_WAIT_S": "3",
        "FLYWHEEL_INGEST_GRACE_S": "1",
        "FLYWHEEL_ARCHIVE_MAX_AGE_S": "10",  # `flywheel reward report` sees the demo's rewards soon
        "FLYWHEEL_INGEST_PORT": "0",
        "FLYWHEEL_REWARD_PORT": "0",
        "FLYWHEEL_TRAINER_PORT": "0",
        "FLYWHEEL_TRAINER_BATCH_SIZE": "16",
        "FLYWHEEL_TRAINER_GROUP_SIZE": "4",
        "FLYWHEEL_TRAINER_PUBLISH_EVERY_STEPS": "1",
        "FLYWHEEL_TRAINER_PUBLISH_EVERY_S": "5",
        "FLYWHEEL_TRAINER_LR": "1e-4",
    }


def prefers(text: str) -> bool:
    """The synthetic users' hidden preference: vowel-rich completions (the fresh model's median
    vowel share is about 0.39, so a bit under half of its completions pass at first)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return bool(letters) and sum(c in "aeiou" for c in letters) / len(letters) > 0.4


def _synthetic_users(base: str, key: str, prompts: int) -> dict[str, str]:
    """Each simulated user asks for 4 samples of one prompt and accepts or rejects each one."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=key)
    model = client.models.list().data[0].id
    judged: dict[str, str] = {}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        for i in range(prompts):
            out = client.completions.create(
                model=model, prompt=PROMPTS[i % len(PROMPTS)], n=4, max_tokens=16, temperature=1.0, user=f"sim-{i}"
            )
            for choice in out.choices:
                gen_id = choice.model_extra["generation_id"]
                verdict = "accept" if prefers(choice.text) else "reject"
                body = {"feedback_id": str(uuid.uuid4()), "generation_id": gen_id, "signal": verdict}
                http.post("/v1/feedback", json=body).raise_for_status()
                judged[gen_id] = verdict
    accepted = sum(v == "accept" for v in judged.values())
    _say(f"{prompts} users x 4 samples: {accepted}/{len(judged)} accepted under the hidden preference")
    return judged


def _show_pipeline(bootstrap: str, topics: Topics, judged: dict[str, str], timeout_s: float) -> None:
    """Wait for every judged generation's reward and the first published checkpoint."""
    reader = _TopicReader(bootstrap, {topics.episodes: EpisodeEvent, topics.rewards: RewardEvent,
                                      topics.checkpoints: CheckpointEvent, topics.deadletter: DeadLetterEvent})
    episodes: list[EpisodeEvent] = reader.seen[topics.episodes]
    rewards: list[RewardEvent] = reader.seen[topics.rewards]
    checkpoints: list[CheckpointEvent] = reader.seen[topics.checkpoints]
    dead: list[DeadLetterEvent] = reader.seen[topics.deadletter]
    deadline = time.monotonic() + timeout_s

    def trained() -> bool:  # v0 is the base model the trainer announces at start
        return any(c.version > 0 for c in checkpoints)

    while time.monotonic() < deadline and not (judged.keys() <= {r.generation_id for r in rewards} and trained()):
        reader.poll()
    reader.close()
    by_signal: dict[str, list[float]] = {}
    for r in rewards:
        by_signal.setdefault(r.signal, []).append(r.reward)
    _say(f"episodes: {len(episodes)}, rewards: {len(rewards)}, dead letters: {len(dead)}")
    for signal_, values in sorted(by_signal.items()):
        _say(f"  reward for {signal_:>6}: n={len(values):3d} mean={sum(values) / len(values):+.3f}")
    for d in dead[:5]:
        _say(f"  dead letter from {d.stage}: {d.reason} ({d.detail[:80]})")
    if not trained():
        _say(f"no trained checkpoint published within {timeout_s:.0f}s (see data_dir/logs/train.log)")
    for c in checkpoints:
        _say(
            f"  checkpoint v{c.version} (parent {c.parent}, step {c.step}, {c.samples} samples, "
            f"{'full' if c.full_snapshot else 'delta'}) at {c.uri}"
        )


def _wait_healthy(base: str, serve: _process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            tail = serve.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"flywheel serve exited with {serve.proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"serving did not become healthy in {timeout_s}s (log: {serve.log_path})")


def _client_session(base: str, key: str) -> list[str]:
    """What a product does: ask for completions, show them, send the user's verdict."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=key)
    model = client.models.list().data[0].id
    _say(f"GET /v1/models -> {model}")
    ids: list[str] = []
    for i, prompt in enumerate(PROMPTS):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=1.0, user=f"user-{i}")
        ids.append(out.id)
        _say(f"completion {out.id} by {out.model}: {out.choices[0].text!r}")
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something kind"}], max_tokens=16, user="user-chat"
    )
    ids.append(chat.id)
    _say(f"chat {chat.id}: {chat.choices[0].message.content!r}")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Stream a few words"}], max_tokens=16, stream=True, user="user-stream"
    )
    pieces, stream_id = [], None
    for chunk in stream:
        stream_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    ids.append(stream_id or "")
    _say(f"streamed {stream_id}: {''.join(pieces)!r} in {len(pieces)} chunks")
    verdicts = [("accept", None), ("reject", None), ("edit", "a better answer"), ("accept", None), ("ignore", None)]
    for gen_id, (signal_, text) in zip(ids, verdicts):
        body = {"feedback_id": str(uuid.uuid4()), "generation_id": gen_id, "signal": signal_, "decision_ms": 1200.0}
        if text:
            body["edited_text"] = text
        r = httpx.post(f"{base}/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        _say(f"POST /v1/feedback {signal_:>6} for {gen_id} -> {r.status_code}")
    bad = httpx.post(f"{base}/v1/feedback", json={"signal": "love"}, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    _say(f"POST /v1/feedback with a bad body -> {bad.status_code}: {bad.json()['error']['message'][:100]}")
    return ids


def _show_topics(bootstrap: str, topics: Topics, expect_generations: int) -> None:
    reader = _TopicReader(bootstrap, {topics.generations: GenerationEvent, topics.feedback: FeedbackEvent})
    generations: list[GenerationEvent] = reader.seen[topics.generations]
    feedback: list[FeedbackEvent] = reader.seen[topics.feedback]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (len(generations) < expect_generations or len(feedback) < 5):
        reader.poll()
    reader.close()
    for g in generations:
        _say(
            f"  {topics.generations}: {g.generation_id} v{g.model_version} user={g.user_id[:8]} "
            f"prompt_tokens={len(g.prompt_token_ids)} completion_tokens={len(g.completion_token_ids)} "
            f"logprobs={len(g.logprobs)} mean_logprob={sum(g.logprobs) / max(1, len(g.logprobs)):.2f} "
            f"finish={g.finish_reason} latency={g.latency_ms:.0f}ms"
        )
    for f in feedback:
        _say(f"  {topics.feedback}: {f.feedback_id[:8]} -> {f.generation_id} {f.signal}")


class _TopicReader:
    """Reads topics from the start, decoding each record with its contract as a consumer would.

    A record that fails its contract is a bug in the demo's own pipeline: it stops the demo
    with the contract's reason rather than being shown as if it were fine.
    """

    def __init__(self, bootstrap: str, contracts: dict[str, type]) -> None:
        from kafka import KafkaConsumer

        self.contracts = contracts
        self.seen: dict[str, list[Any]] = {t: [] for t in contracts}
        self.consumer = KafkaConsumer(*contracts, bootstrap_servers=bootstrap, group_id=None,
                                      auto_offset_reset="earliest", enable_auto_commit=False)

    def poll(self) -> None:
        for recs in self.consumer.poll(timeout_ms=500).values():
            for r in recs:
                self.seen[r.topic].append(decode(self.contracts[r.topic], r.value))

    def close(self) -> None:
        self.consumer.close()
