"""Reward labelers: pure functions from an episode to named reward components, composed by config.

A labeler is ``(EpisodeEvent) -> dict[str, float]``; it returns the components it has an opinion
on (an empty dict when it does not apply). The reward is the sum of every configured labeler's
components, so each part stays visible in ``RewardEvent.components`` and in the archive.

Built in (``reward.labelers`` names them, in order):

- ``signal``   accept / reject / ignore values, asymmetric by default (+0.75 / -0.25 / 0): a
               reject is a weaker, noisier signal than an accept on these products.
- ``edit``     partial credit for an edit: the reward slides from ``reject_value`` (the user
               rewrote everything) to ``accept_value`` (the user changed nothing) with the
               normalised Levenshtein similarity between the completion and the final text.
- ``latency``  a fast decision is a confident one: up to ``latency_bonus`` in the direction of
               the decision, fading linearly to 0 at ``latency_ref_ms``.
- ``verifier:<name>``      a function registered with :func:`register_verifier`.
- ``reward_model:<name>``  a :class:`RewardModel` registered with :func:`register_reward_model`.

Your own verifiers, reward models and labelers live in your own modules, named in
``reward.plugins``; the stage imports them at start-up, and they call the ``register_*``
functions at import. A module that cannot be imported stops the stage before it consumes anything.

A labeler that raises, returns something other than a dict of components, names a component
with something other than a string (or with a name the guards use, ``length_penalty`` and
``repetition_penalty``, or with one an earlier labeler gave: each component is one labeler's, so
none is silently replaced), or gives a component that is not a finite real number (an int or a
float, numpy's, a one-element tensor...; not a bool, nor a string of digits), fails that episode only: the stage
dead-letters it as ``labeler_error``, naming the labeler (both, for a name given twice), and goes
on. Replay it with ``flywheel deadletters replay --reason labeler_error`` once the labeler is
fixed. A reward model behind a network call should retry transient errors itself: what it raises
is final for that episode. A labeler named twice in ``reward.labelers`` stops the stage at
start-up, as an unknown one does: it would give its components twice on every episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from math import isfinite

from rapidfuzz.distance import Levenshtein

from flywheel import scorers
from flywheel.contracts import SIGNALS, EpisodeEvent
from flywheel.scorers import RewardModel, Verifier
from flywheel.settings import RewardSettings, SettingsError
from reward.guards import GUARD_COMPONENTS

Labeler = Callable[[EpisodeEvent], dict[str, float]]

_FACTORIES: dict[str, Callable[[RewardSettings], Labeler]] = {}
# verifiers and reward models live in the shared registry: the release gate scores with them too
_VERIFIERS = scorers.VERIFIERS
_REWARD_MODELS = scorers.REWARD_MODELS


def register_labeler(name: str) -> Callable[[Callable[[RewardSettings], Labeler]], Callable[[RewardSettings], Labeler]]:
    def deco(factory: Callable[[RewardSettings], Labeler]) -> Callable[[RewardSettings], Labeler]:
        _FACTORIES[name] = factory
        return factory
    return deco


#: Kept here too for plugins written against this module; new ones import flywheel.scorers.
register_verifier = scorers.register_verifier
register_reward_model = scorers.register_reward_model


# -- pure scoring rules (table-tested) ----------------------------------------------------
def signal_value(signal: str, cfg: RewardSettings) -> float | None:
    return {"accept": cfg.accept_value, "reject": cfg.reject_value, "ignore": cfg.ignore_value}.get(signal)


#: The direction of a decision: the latency bonus rewards a fast accept and punishes a fast reject.
_DIRECTION = {"accept": 1.0, "reject": -1.0}


def edit_similarity(completion: str, final: str, max_chars: int | None = None) -> float:
    """1 - Levenshtein distance / the longer length; 1.0 for two empty texts.

    Levenshtein costs the product of the lengths, and the user's text is theirs to make long.
    With ``max_chars``, longer texts are compared on their first and on their last ``max_chars``
    characters, and score the smaller of the two similarities, capped by shorter length / longer
    length: no pair of texts of those lengths scores more, as their distance is at least the
    difference of the lengths. A 1 MB "edit" of a short completion so scores about 0, as the exact
    distance would, in milliseconds. The approximation: an edit confined to the middle of two
    texts longer than ``2 x max_chars`` is not seen, and an edit at one end is measured against
    its window of ``max_chars`` characters rather than the whole text, so it weighs more than in
    the exact similarity (10,000 characters rewritten at the end of 30,000 score 0.5 with a
    window of 20,000, not 2/3).
    """
    longer = max(len(completion), len(final))
    if max_chars is None or longer <= max_chars:
        return float(Levenshtein.normalized_similarity(completion, final))
    head = Levenshtein.normalized_similarity(completion[:max_chars], final[:max_chars])
    # the tail too: the prefixes alone would score a rewrite of everything past them as no edit
    tail = Levenshtein.normalized_similarity(completion[-max_chars:], final[-max_chars:])
    return float(min(head, tail, min(len(completion), len(final)) / longer))


def edit_value(similarity: float, cfg: RewardSettings) -> float:
    return cfg.reject_value + (cfg.accept_value - cfg.reject_value) * similarity


def latency_value(signal: str, decision_ms: float | None, cfg: RewardSettings) -> float:
    direction = _DIRECTION.get(signal, 0.0)
    if decision_ms is None or direction == 0.0 or cfg.latency_bonus == 0.0:
        return 0.0
    return direction * cfg.latency_bonus * max(0.0, 1.0 - decision_ms / cfg.latency_ref_ms)


# -- built-in labelers ----------------------------------------------------------------------
@register_labeler("signal")
def _signal(cfg: RewardSettings) -> Labeler:
    values = {signal: signal_value(signal, cfg) for signal in SIGNALS}  # once, not per episode

    def label(ep: EpisodeEvent) -> dict[str, float]:
        value = values.get(ep.signal)
        return {} if value is None else {"signal": value}
    return label


@register_labeler("edit")
def _edit(cfg: RewardSettings) -> Labeler:
    def label(ep: EpisodeEvent) -> dict[str, float]:
        if ep.signal != "edit" or ep.edited_text is None:
            return {}
        similarity = edit_similarity(ep.generation.completion_text, ep.edited_text, cfg.edit_max_chars)
        return {"edit": edit_value(similarity, cfg)}
    return label


@register_labeler("latency")
def _latency(cfg: RewardSettings) -> Labeler:
    def label(ep: EpisodeEvent) -> dict[str, float]:
        value = latency_value(ep.signal, ep.decision_ms, cfg)
        return {"latency": value} if value else {}
    return label


def _nonempty(ep: EpisodeEvent) -> float | None:
    """Example verifier: an empty completion is wrong whatever the user clicked."""
    return -1.0 if not ep.generation.completion_text.strip() else None


register_verifier("nonempty", _nonempty)


class LabelerError(Exception):
    """A labeler failed on one episode: it raised, returned something other than a dict of
    numbers, gave a component that is not finite, a guard's name or a name another labeler
    gives too; or the components add up to a reward that is not finite."""

    def __init__(self, labeler: str, detail: str) -> None:
        super().__init__(f"labeler {labeler!r}: {detail}")


def load_plugins(modules: tuple[str, ...]) -> None:
    """Import ``reward.plugins``; a module that fails to import stops the stage with the reason."""
    scorers.load_plugins(modules, "reward.plugins")


def build_labeler(cfg: RewardSettings) -> Labeler:
    """Compose the configured labelers into one; unknown or repeated names fail here, at start-up.

    The composed labeler raises :class:`LabelerError` for an episode one of them fails on.
    """
    load_plugins(cfg.plugins)
    if twice := sorted({name for name in cfg.labelers if cfg.labelers.count(name) > 1}):
        raise SettingsError(f"reward.labelers: {', '.join(map(repr, twice))} named more than once; "
                            "each labeler's components count once")
    parts = [(name, _labeler_named(name, cfg)) for name in cfg.labelers]
    # Names that passed the checks of a name alone (a str UTF-8 can encode, not a guard's): the
    # same few names come back on every episode, and checking them again cost more than labeling.
    named_ok: set[str] = set()

    def label(ep: EpisodeEvent) -> dict[str, float]:
        out: dict[str, float] = {}
        given_by: dict[str, str] = {}  # component -> the labeler that gave it
        for name, part in parts:
            try:
                got = part(ep)
            except Exception as exc:  # one episode fails, not the stage
                raise LabelerError(name, f"{type(exc).__name__}: {exc}") from exc
            if type(got) is not dict and not isinstance(got, Mapping):
                raise LabelerError(name, f"returned {type(got).__name__}, not a dict of components")
            for key, value in got.items():
                if type(key) is not str or key in given_by or key not in named_ok:
                    _check_component_name(name, key, given_by)
                    named_ok.add(key)
                # a finite float is taken as it is; anything else is converted or refused
                out[key] = value if type(value) is float and isfinite(value) else _component_value(name, key, value)
                given_by[key] = name
        # finite parts can still add up to infinity (two of 1e308): JSON writes that reward as
        # null, which the archive and the trainer refuse, so it fails here, on its one episode
        if out and not math.isfinite(total := sum(out.values())):
            raise LabelerError(" + ".join(name for name, _ in parts),
                               f"components add up to {total}, not a finite reward")
        return out
    return label


def _labeler_named(name: str, cfg: RewardSettings) -> Labeler:
    """The registered labeler ``name`` (``verifier:<v>``, ``reward_model:<m>`` or a labeler's)."""
    kind, _, arg = name.partition(":")
    if kind == "verifier" and arg in _VERIFIERS:
        return _verifier_labeler(arg, _VERIFIERS[arg])
    if kind == "reward_model" and arg in _REWARD_MODELS:
        return _model_labeler(arg, _REWARD_MODELS[arg](cfg))
    if name in _FACTORIES:
        return _FACTORIES[name](cfg)
    known = sorted(_FACTORIES) + [f"verifier:{v}" for v in _VERIFIERS] + [
        f"reward_model:{m}" for m in _REWARD_MODELS]
    raise SettingsError(f"reward.labelers: unknown labeler {name!r}; known: {', '.join(known)}"
                        + ("" if cfg.plugins else " (your own register in reward.plugins modules)"))


def _check_component_name(labeler: str, key: object, given_by: dict[str, str]) -> None:
    """Raise :class:`LabelerError` unless ``key`` is a name this labeler may give its component."""
    if not _is_component_name(key):
        raise LabelerError(labeler, f"component name {key!r} is not a str that UTF-8 can encode")
    if key in GUARD_COMPONENTS:
        raise LabelerError(labeler, f"component name {key!r} is the reward guards' own")
    if key in given_by:  # kept, one would replace the other, and the reward lose a part unseen
        raise LabelerError(labeler, f"component {key!r} was given by labeler {given_by[key]!r} already")


def _component_value(labeler: str, key: str, value: object) -> float:
    """``value`` as a plain float (whatever number type the labeler used: numpy's...), or
    :class:`LabelerError` when it is not a finite real number."""
    number = math.nan
    # float() would also take "0.5", b"1" and True: a labeler returning those has a bug (a score
    # read from text, a flag), and the reward would carry it unseen. Numbers of any type convert
    # (numpy's, Decimal, a reward model's one-element tensor): each defines __float__.
    if not isinstance(value, (bool, str, bytes, bytearray)) and hasattr(type(value), "__float__"):
        try:
            number = float(value)
        except Exception:  # noqa: BLE001 - an int past float's range, a tensor of several values...
            number = math.nan
    if not math.isfinite(number):
        raise LabelerError(labeler, f"component {key!r} is {value!r}, not a finite number")
    return number


def _is_component_name(key: object) -> bool:
    """A name the reward record and the archive can carry: a str with no lone surrogate."""
    if not isinstance(key, str):
        return False
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _verifier_labeler(name: str, fn: Verifier) -> Labeler:
    def label(ep: EpisodeEvent) -> dict[str, float]:
        value = fn(ep)
        # as given: the composed labeler takes real numbers only, and says which one it refused
        return {} if value is None else {f"verifier_{name}": value}
    return label


def _model_labeler(name: str, model: RewardModel) -> Labeler:
    def label(ep: EpisodeEvent) -> dict[str, float]:
        # the model scores what the policy produced, not the user's rewrite
        return {f"rm_{name}": model.score(ep.generation.prompt_text, ep.generation.completion_text)}
    return label
