"""The continuous DeepSpeed trainer: consumes labeled samples from the rewards topic, trains the
policy with an off-policy-corrected policy-gradient loss, and publishes verified versions with
lossless weight deltas. See docs/trainer.md; run with ``flywheel train``."""
