"""Trainer throughput: samples/s through the whole service loop vs the bare training primitives.

Starts the embedded broker, writes N reward records, and runs the real trainer loop in this
process (Kafka intake, validation, batching, DeepSpeed steps, versions published every K steps)
until every record is trained. The baseline, in the same process on the same batches, is the bare
``forward_backward`` + ``step`` loop with no Kafka and no publishing. Reports samples/s of both,
their ratio, and the share of the service's wall time spent waiting for data.

    .venv/bin/python bench/trainer_throughput.py [--samples 512] [--batch 16] [--publish-every 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from trainer_helpers import reward_event

from flywheel.contracts import Topics, encode
from flywheel.kafka.clients import make_producer
from flywheel.kafka.topics import ensure_declared
from flywheel.modelinit import ModelSpec, init_model
from flywheel.settings import KafkaSettings, Settings, TrainerSettings
from local.broker import EmbeddedBroker


def produce(kafka: KafkaSettings, topic: str, n: int) -> list:
    events = [reward_event(i, completion=tuple(10 + (i * 7 + k) % 300 for k in range(24)), logprobs=tuple([-5.0] * 24)) for i in range(n)]
    p = make_producer(kafka, "bench")
    for e in events:
        p.send(topic, key=e.generation_id, value=encode(e))
    p.flush()
    p.close()
    return events


def service(settings: Settings, n: int) -> tuple[float, float, int]:
    """The real loop, in the main thread (torch's thread settings are per thread); a watcher
    thread stops it once every sample is trained."""
    from trainer.main import build

    trainer, registry = build(settings)
    trainer.start()
    trainer.subscribe()

    def watch() -> None:
        while trainer.samples < n:
            time.sleep(0.005)
        trainer.stop_event.set()

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    trainer.run()
    wall = time.perf_counter() - t0
    wait = registry.get_sample_value("trainer_data_wait_seconds_total")
    trainer.consumer.close()
    trainer.sink.close()
    return n / wall, wait / wall, trainer.version


def bare(settings: Settings, events: list, batch: int) -> float:
    from trainer import dist
    from trainer.losses import LossConfig
    from trainer.policy import Policy, default_ds_config

    t = settings.trainer
    dist.cpu_threads(t.cpu_threads)
    policy = Policy.load(settings.model_dir, default_ds_config(batch, 1), LossConfig(t.loss, entropy_coef=t.entropy_coef, kl_coef=t.kl_coef), lr=t.lr)
    policy.forward_backward(events[:batch])  # warm-up step, untimed (the service's v0 publish warms it too)
    policy.step()
    t0 = time.perf_counter()
    for i in range(0, len(events) - batch + 1, batch):
        policy.forward_backward(events[i : i + batch])
        policy.step()
    return (len(events) // batch * batch) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--publish-every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (TrainerSettings.cpu_threads)")
    args = ap.parse_args()
    from trainer import dist

    dist.init()
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as d:
        kafka = KafkaSettings(bootstrap=broker.bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500, partitions=2)
        topics = Topics(f"b{uuid.uuid4().hex[:8]}.")
        ensure_declared(kafka, topics)
        model = init_model(Path(d) / "model", ModelSpec())
        events = produce(kafka, topics.rewards, args.samples)
        settings = Settings(
            model_dir=model, data_dir=Path(d) / "data", topic_prefix=topics.prefix, kafka=kafka,
            # every record is written as version 0: a staleness bound below the run's last version would
            # drop the tail as stale and the service would never reach --samples
            trainer=TrainerSettings(loss="reinforce", batch_size=args.batch, publish_every_steps=args.publish_every, port=0,
                                    cpu_threads=args.threads, max_staleness=args.samples // (args.batch * args.publish_every) + 1),
        )
        rate, wait_frac, versions = service(settings, args.samples)
        base = bare(settings, events, args.batch)
    print(f"\n{args.threads} intra-op thread(s); {args.samples} samples x 24 completion tokens, batch {args.batch}, a version every {args.publish_every} steps "
          f"({versions} published)")
    print(f"{'run':<34} | {'samples/s':>9} | {'ratio':>6} | {'data wait':>9}")
    print(f"{'bare primitives (baseline)':<34} | {base:9.1f} | {1.0:6.2f} | {'-':>9}")
    print(f"{'service loop (Kafka+publish)':<34} | {rate:9.1f} | {rate / base:6.2f} | {wait_frac * 100:8.1f}%")


if __name__ == "__main__":
    main()
