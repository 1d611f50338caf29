"""Helpers for the trainer's integration tests: reward records and the trainer's environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flywheel.contracts import RewardEvent, SamplingParams
from flywheel.metrics import new_registry
from flywheel.settings import Settings, TrainerSettings


class ListSink:
    """A trainer's dead-letter sink that keeps what it is given: ``(topic, key, value)``."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str | None, bytes]] = []

    def write(self, topic: str, key: str | None, value: bytes) -> None:
        self.records.append((topic, key, value))

    def flush(self, timeout_s: float | None = None) -> None:
        return None

    def close(self) -> None:
        return None


def reward_event(i: int, *, group: str | None = None, reward: float | None = None, version: int = 0,
                 completion: tuple[int, ...] | None = None, logprobs: tuple[float, ...] | None = None) -> RewardEvent:
    comp = completion if completion is not None else tuple(10 + (i * 7 + k) % 200 for k in range(6))
    return RewardEvent(
        generation_id=f"gen-{i}",
        group_id=group or f"grp-{i}",
        user_id=f"user-{i % 5}",
        model_version=version,
        signal="accept" if (reward if reward is not None else i % 2) else "reject",
        prompt_token_ids=(1, 20 + i % 30, 40 + i % 17),
        completion_token_ids=comp,
        logprobs=logprobs if logprobs is not None else tuple(-5.0 for _ in comp),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16),
        reward=float(reward if reward is not None else i % 2),
        generated_at=0.0,
        labeled_at=0.0,
    )


def send_rewards(kafka_settings, topic: str, ids: range) -> None:
    """Reward events ``ids`` (:func:`reward_event`) on ``topic``, keyed by generation, all acked."""
    from flywheel.contracts import encode
    from flywheel.kafka.clients import make_producer

    producer = make_producer(kafka_settings, "test")
    for i in ids:
        producer.send(topic, key=f"gen-{i}", value=encode(reward_event(i)))
    producer.flush()
    producer.close()


def trainer_env(kafka_settings, prefix: str, model_dir: Path, data_dir: Path, **trainer: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        FLYWHEEL_KAFKA_BOOTSTRAP=kafka_settings.bootstrap,
        FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS=str(kafka_settings.session_timeout_ms),
        FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS=str(kafka_settings.heartbeat_interval_ms),
        FLYWHEEL_TOPIC_PREFIX=prefix,
        FLYWHEEL_MODEL_DIR=str(model_dir),
        FLYWHEEL_DATA_DIR=str(data_dir),
        FLYWHEEL_TRAINER_PORT="0",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        # the checkout first, then whatever path this run was given (packages installed there)
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.update({f"FLYWHEEL_TRAINER_{k.upper()}": str(v) for k, v in trainer.items()})
    return env


PYTHON = sys.executable
#: The checkout: trainer subprocesses run from it (and import it first).
ROOT = Path(__file__).resolve().parents[2]


def make_trainer(model_dir: Path, data_dir: Path, trainer_kw: dict | None = None, topic_prefix: str = "flywheel.",
                 **cfg):
    """A :class:`trainer.loop.Trainer` in this process (on the engine's device: the CPU, or a GPU
    where DeepSpeed's accelerator is cuda), with no Kafka clients unless
    ``trainer_kw`` gives them (``consumer``, ``sink``, ``deadletters``): its steps and publishes
    can be driven directly. ``cfg``: trainer settings."""
    from flywheel.checkpoints import open_store
    from trainer import dist
    from trainer.loop import Trainer
    from trainer.losses import LossConfig
    from trainer.main import ds_config
    from trainer.metrics import TrainerMetrics
    from trainer.policy import LoraSpec, Policy

    dist.init()
    settings = Settings(model_dir=model_dir, data_dir=data_dir, topic_prefix=topic_prefix,
                        trainer=TrainerSettings(**cfg))
    t = settings.trainer
    loss = LossConfig(t.loss, t.clip_low, t.clip_high, t.tis_cap, t.entropy_coef, t.kl_coef)
    policy = Policy.load(model_dir, ds_config(settings, 1), loss, lr=t.lr, lora=LoraSpec.of(t))
    return Trainer(settings, policy, open_store(settings), TrainerMetrics(new_registry()), **(trainer_kw or {}))
