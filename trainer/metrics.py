"""The trainer's Prometheus metrics (``trainer_<what>_<unit>``), one object per process.

Collapse signals are first-class: per-token entropy and the share of distinct completions in a
batch fall long before reward says anything is wrong.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.steps = Counter("trainer_steps_total", "Optimizer steps taken", registry=r)
        self.samples = Counter("trainer_samples_total", "Samples trained on", registry=r)
        self.loss = Gauge("trainer_loss_value", "Total loss of the last step", registry=r)
        self.reward = Gauge("trainer_reward_mean", "Mean reward of the last batch", registry=r)
        self.kl = Gauge("trainer_kl_nats", "Per-token KL to the reference policy, last batch", registry=r)
        self.entropy = Gauge("trainer_entropy_nats", "Per-token policy entropy, last batch", registry=r)
        self.distinct = Gauge("trainer_distinct_completions_ratio", "Distinct completions / batch size", registry=r)
        self.ratio = Gauge("trainer_importance_ratio", "Trainer/behaviour ratio over the last batch's tokens", ["stat"], registry=r)
        self.clip = Gauge("trainer_clip_ratio", "Share of tokens (or sequences) clipped, last batch", registry=r)
        self.tis = Gauge("trainer_tis_truncated_ratio", "Share of tokens whose IS weight hit the cap", registry=r)
        self.gap = Gauge("trainer_logprob_gap_nats", "Mean |trainer - behaviour| logprob per token", registry=r)
        self.staleness = Histogram(
            "trainer_staleness_versions", "Trainer version minus sample version, per accepted sample",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=r,
        )
        self.dropped = Counter("trainer_dropped_total", "Samples not trained on, by reason", ["reason"], registry=r)
        self.wait = Counter("trainer_data_wait_seconds_total", "Time spent waiting for data", registry=r)
        self.busy = Counter("trainer_busy_seconds_total", "Time spent training and publishing", registry=r)
        self.step_time = Histogram(
            "trainer_step_seconds", "Forward+backward+step time",
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30), registry=r,
        )
        self.publish_time = Histogram("trainer_publish_seconds", "Time to publish a version", registry=r)
        self.version = Gauge("trainer_version", "Latest published version", registry=r)
        self.stalled = Gauge("trainer_stalled_seconds", "Seconds records have been owed to Kafka (dead letters, "
                             "announcements) with no ack, or the checkpoint store has been out of reach, "
                             "whichever is longer; 0 while both are fine", registry=r)
        self.delta_bytes = Gauge("trainer_delta_bytes", "Size of the last published delta", registry=r)
        self.trained_tokens = Counter("trainer_trained_tokens_total", "Tokens of the samples trained on, by the "
                                      "version they go into and kind (prompt, completion)", ["version", "kind"],
                                      registry=r)
        self.delta_ratio = Gauge("trainer_delta_compression_ratio", "Full weight bytes / delta bytes, last version", registry=r)

    def record_step(self, stats: dict[str, float], seconds: float, samples: int) -> None:
        self.steps.inc()
        self.samples.inc(samples)
        self.step_time.observe(seconds)
        self.loss.set(stats.get("loss", 0.0))
        self.reward.set(stats.get("reward_mean", 0.0))
        self.kl.set(stats.get("kl", 0.0))
        self.entropy.set(stats.get("entropy", 0.0))
        self.distinct.set(stats.get("distinct_frac", 0.0))
        for s in ("mean", "max", "min"):
            self.ratio.labels(s).set(stats.get(f"ratio_{s}", 1.0))
        self.clip.set(stats.get("clip_frac", 0.0))
        self.tis.set(stats.get("tis_frac", 0.0))
        self.gap.set(stats.get("logprob_gap", 0.0))

    def record_trained_tokens(self, version: int, prompt: int, completion: int) -> None:
        self.trained_tokens.labels(str(version), "prompt").inc(prompt)
        self.trained_tokens.labels(str(version), "completion").inc(completion)
