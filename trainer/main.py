"""``flywheel train``: the continuous trainer process (one per rank).

Single process::

    flywheel train

Several processes or nodes, through the standard launchers (each rank runs this same entrypoint;
rank 0 consumes Kafka and publishes, every rank trains its shard)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m trainer
    deepspeed --num_gpus 8 -m trainer            # or --hostfile for multi-node

Settings come from ``FLYWHEEL_TRAINER_*`` (see flywheel/settings.py, TrainerSettings); the
DeepSpeed JSON config (ZeRO stage, precision, optimizer) from ``FLYWHEEL_TRAINER_DEEPSPEED_CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path
from typing import Any, NoReturn

from flywheel.settings import Settings

log = logging.getLogger(__name__)


def ds_config(settings: Settings, world: int) -> dict[str, Any]:
    from trainer.policy import default_ds_config

    cfg = settings.trainer
    if cfg.deepspeed_config is None:
        return default_ds_config(cfg.batch_size, world)
    data = json.loads(Path(cfg.deepspeed_config).read_text())
    # Batch sizes are the trainer's decision (one backward per local shard); keep DeepSpeed's
    # bookkeeping consistent with it whatever the file says.
    data.pop("train_batch_size", None)
    data["train_micro_batch_size_per_gpu"] = max(1, cfg.batch_size // world)
    data["gradient_accumulation_steps"] = 1
    return data


def build(settings: Settings):
    """Everything but the loop: process group, policy, store, Kafka clients (rank 0), metrics."""
    from flywheel.checkpoints import open_store
    from flywheel.contracts import Topics
    from flywheel.kafka.clients import make_consumer, make_producer
    from flywheel.kafka.lag import LagGauge
    from flywheel.kafka.producers import KafkaSink
    from flywheel.kafka.topics import ensure_declared
    from flywheel.metrics import new_registry
    from flywheel.stream.deadletters import DeadLetters
    from flywheel.topology import Role, role_topics
    from trainer import dist
    from trainer.batching import DEADLETTER_REASONS
    from trainer.loop import Trainer
    from trainer.losses import LossConfig
    from trainer.metrics import TrainerMetrics
    from trainer.policy import LoraSpec, Policy

    rank, world = dist.init()
    cfg = settings.trainer
    dist.cpu_threads(cfg.cpu_threads)
    loss_cfg = LossConfig(cfg.loss, cfg.clip_low, cfg.clip_high, cfg.tis_cap, cfg.entropy_coef, cfg.kl_coef)
    policy = Policy.load(settings.model_dir, ds_config(settings, world), loss_cfg, lr=cfg.lr,
                         reference_dir=cfg.reference_dir, lora=LoraSpec.of(cfg))
    registry = new_registry()
    kw: dict[str, Any] = {}
    if rank == 0:
        topics = Topics(settings.topic_prefix)
        ensure_declared(settings.kafka, topics, role_topics(Role.TRAINER))  # as flywheel/topology.py declares them
        # bounded like the stages' output producer: a broker that does not answer holds a send
        # for seconds, and the sink retries it later (flywheel/kafka/producers.py, KafkaSink)
        sink = KafkaSink(lambda: make_producer(settings.kafka, "trainer", max_block_ms=5000,
                                               bootstrap_timeout_ms=5000))
        kw = {
            "consumer": make_consumer(settings.kafka, "trainer", cfg.group_id, max_poll_records=max(256, 4 * cfg.batch_size)),
            "sink": sink,
            "deadletters": DeadLetters(sink, topics.deadletter, "trainer", registry, DEADLETTER_REASONS),
            "lag": LagGauge("trainer", registry),
        }
    trainer = Trainer(settings, policy, open_store(settings), TrainerMetrics(registry), rank=rank, world=world, **kw)
    return trainer, registry


def run(settings: Settings, args: argparse.Namespace | None = None) -> NoReturn:
    from flywheel.metrics import serve_ops
    from flywheel.probes import Probes, alive

    # SIGTERM and SIGINT are blocked while the process group and the engine start, so every
    # thread started then (gloo's among them) inherits the block and only this thread takes them:
    # delivered to a gloo thread, a handled signal would interrupt its socket call
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    trainer, registry = build(settings)
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: trainer.stop_event.set())
    trainer.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)  # one sent meanwhile arrives now
    if trainer.rank == 0:
        # opens once the model is loaded and resumed (minutes for a large one): the manifest's
        # startupProbe waits for it (deploy/k8s/base/trainer.yaml)
        probes = Probes(alive(trainer.heartbeat, settings.probes.hung_s),
                        lambda: trainer.healthy(settings.probes.stale_s))
        server = serve_ops(registry, probes, settings.trainer.host, settings.trainer.port, component="trainer")
        log.info("trainer ops on %s:%d, version %d", settings.trainer.host, server.server_port, trainer.version)
        trainer.subscribe()
    try:
        trainer.run()
    finally:
        if trainer.rank == 0:
            trainer.consumer.close(autocommit=False, timeout_ms=5000)
            trainer.sink.close()
        from trainer import dist

        dist.shutdown()
    # a stop ends the process here, not in interpreter teardown, where gloo's threads abort it
    # now and then (trainer/dist.py, exit_process); an error above still exits the usual way
    dist.exit_process(0)

