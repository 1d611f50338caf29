"""Reward stage: label episodes with rewards behind abuse and reward-hacking guards (``flywheel reward``)."""
