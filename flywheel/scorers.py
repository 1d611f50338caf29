"""Scorers a deployment plugs in by name: verifiers and reward models.

Registered by the deployment's own plugin modules (``reward.plugins``, ``release.plugins``) and
read by every stage that scores answers: the reward stage labels episodes with them
(reward/labelers.py), the release gate scores candidate and stable on the held-out prompts with
them (release/gate.py). A registry, not stage logic: what a scorer means is the stage's business.

    # mycompany/flywheel_rewards.py
    from flywheel.scorers import register_reward_model, register_verifier

    register_verifier("compiles", lambda ep: 0.5 if compiles(ep.generation.completion_text) else None)
    register_reward_model("helpful", lambda cfg: HelpfulnessScorer())  # .score(prompt, completion)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from flywheel.contracts import EpisodeEvent
from flywheel.settings import SettingsError

#: A verifier returns a score for episodes it can check, None for the others.
Verifier = Callable[[EpisodeEvent], float | None]


class RewardModel(Protocol):
    """A learned scorer of (prompt, completion); plugged in by name, not hard-coded."""

    def score(self, prompt: str, completion: str) -> float: ...


VERIFIERS: dict[str, Verifier] = {}
#: name -> factory taking the reward settings (a model may read its own options there)
REWARD_MODELS: dict[str, Callable[[Any], RewardModel]] = {}


def register_verifier(name: str, fn: Verifier) -> None:
    VERIFIERS[name] = fn


def register_reward_model(name: str, factory: Callable[[Any], RewardModel]) -> None:
    REWARD_MODELS[name] = factory


def load_plugins(modules: tuple[str, ...], setting: str) -> None:
    """Import the deployment's plugin modules; one that fails to import is a configuration error
    naming ``setting`` (the stage stops at start with the reason)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure of the user's module is a config error
            raise SettingsError(f"{setting}: cannot import {name!r}: {type(exc).__name__}: {exc}") from exc


def known() -> list[str]:
    return [f"verifier:{v}" for v in sorted(VERIFIERS)] + [f"reward_model:{m}" for m in sorted(REWARD_MODELS)]
