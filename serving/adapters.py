"""Adapter versions on one engine: stable and canary as LoRA adapters on the base serving holds.

A version the trainer published in LoRA mode is a PEFT adapter on a named base
(flywheel/adapters.py). With ``serve.lora`` on, serving starts ONE vLLM engine of its
``model_dir`` with vLLM's LoRA support (``enable_lora``, ``serve.max_loras``,
``serve.max_lora_rank``) and the fleet's two slots (serving/versions.py) are
:class:`AdapterSlot` views of it: each holds one version, the base itself (version 0, no adapter)
or one adapter, and runs every request routed to it with that adapter's ``LoRARequest``. The
routing, stickiness and swap plans are the full-weight path's, unchanged: only what a "load" is
differs. Loading a version into a slot is ``add_lora`` on the running engine (milliseconds on the
tiny model; nothing pauses, no weights reload); the adapter it replaced is removed once the last
request that started on it has finished, so a request runs its whole length on one adapter and is
recorded under the version that sampled every one of its tokens.

What a slot may hold is judged before anything loads (:func:`judge_version`, pure): an adapter
must name serving's own base (the sha256 of ``model_dir``'s manifest, and every file of the base
checked once by :func:`~flywheel.checkpoints.verify_base`) and fit ``serve.max_lora_rank``; a
full-weight version other than the base cannot share the base's engine (``needs_full_engines``),
and serving with full-weight engines refuses adapters (``needs_lora_engine``). Each refusal is a
release refusal like a failed hash (serving/follow.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flywheel.checkpoints.manifest import Adapter
from flywheel.settings import Settings
from serving.engine import Delta, GenRequest, VllmEngine

log = logging.getLogger(__name__)

#: Release refusal reasons of this module (serving/follow.py counts and reports them).
LORA_REFUSALS = ("needs_full_engines", "needs_lora_engine", "wrong_base", "lora_rank_too_high")


def lora_on(settings: Settings) -> bool:
    """Whether serving runs the one adapter engine (``serve.lora``; ``auto``: the trainer trains LoRA)."""
    mode = settings.serve.lora
    return mode == "on" or (mode == "auto" and settings.trainer.lora_rank > 0)


@dataclass(frozen=True)
class Refusal:
    reason: str
    detail: str


def judge_version(version: int, adapter: Adapter | None, *, is_base: bool, lora_engine: bool,
                  base_sha256: str, max_rank: int) -> Refusal | None:
    """Whether serving can load ``version`` (its manifest's ``adapter`` entry, or None for full
    weights; ``is_base``: the version is the model directory serving started on). None: it can."""
    if adapter is None:
        if lora_engine and not is_base:
            return Refusal("needs_full_engines",
                           f"version {version} holds full weights; this serving runs one engine of its base with "
                           "LoRA adapters (serve.lora): serve it with serve.lora=off (full-weight engines)")
        return None
    if not lora_engine:
        return Refusal("needs_lora_engine",
                       f"version {version} is a LoRA adapter on {adapter.base_name!r}; this serving runs full-weight "
                       "engines (serve.lora=off): set serve.lora=on, or publish it merged (flywheel checkpoint merge)")
    if adapter.base_manifest_sha256 != base_sha256:
        return Refusal("wrong_base",
                       f"version {version} is an adapter on base {adapter.base_name!r} (manifest "
                       f"{adapter.base_manifest_sha256[:12]}…); this serving's base has manifest {base_sha256[:12]}…")
    if adapter.rank > max_rank:
        return Refusal("lora_rank_too_high",
                       f"version {version} has LoRA rank {adapter.rank}, above serve.max_lora_rank={max_rank}")
    return None


class AdapterSlot:
    """One slot's view of the shared adapter engine (:class:`~serving.engine.Engine`): the version
    it holds and that version's ``LoRARequest`` (None: the base itself)."""

    def __init__(self, shared: VllmEngine, base_dir: Path, ids: Iterator[int], *, reports_stats: bool) -> None:
        self.shared, self.base_dir, self._ids = shared, Path(base_dir).resolve(), ids
        self.tokenizer = shared.tokenizer
        self.max_model_len = shared.max_model_len
        self.logprobs_mode = shared.logprobs_mode
        self.model_version = shared.model_version
        # the engine's statistics are one engine's: one slot exports them (serving/engine_stats.py)
        self.stats = shared.stats if reports_stats else None
        self._lora: Any = None
        #: requests running per adapter id, so an adapter is removed only after its last one
        self._running: Counter[int] = Counter()
        #: adapters replaced but still running requests: id -> (version, its removal task)
        self.retiring: dict[int, tuple[int, asyncio.Task[None]]] = {}

    def resident_versions(self) -> set[int]:
        """The version it serves and those its replaced adapters still answer (their directories
        stay: vLLM reads an evicted adapter again from its path)."""
        return {self.model_version, *(v for v, _ in self.retiring.values())}

    async def stream(self, req: GenRequest, request_id: str) -> AsyncIterator[Delta]:
        lora = self._lora
        with self._using(lora):
            async for d in self.shared.stream(req, request_id, lora=lora):
                yield _own(d)

    async def complete(self, req: GenRequest, request_id: str) -> Delta:
        lora = self._lora
        with self._using(lora):
            return _own(await self.shared.complete(req, request_id, lora=lora))

    def healthy(self) -> bool:
        return self.shared.healthy()

    async def reload(self, model_dir: Path, version: int) -> float:
        """Hold ``version`` from its verified directory: add its adapter to the running engine (or
        none, for the base), route this slot's new requests to it, and remove the adapter it
        replaced once that adapter's last request ends. Nothing pauses: returns 0.0."""
        from flywheel.adapters import adapter_in

        lora = None
        if adapter_in(model_dir) is not None:
            from vllm.lora.request import LoRARequest

            lid = next(self._ids)
            lora = LoRARequest(lora_name=f"v{version}#{lid}", lora_int_id=lid, lora_path=str(model_dir))
            await self.shared.add_adapter(lora)
        elif Path(model_dir).resolve() != self.base_dir:  # judge_version refuses this before a load
            raise ValueError(f"version {version} holds full weights: the adapter engine serves its base only")
        old, old_version = self._lora, self.model_version
        self._lora, self.model_version = lora, version
        if old is not None:
            self.retiring[old.lora_int_id] = (old_version, asyncio.create_task(self._retire(old)))
        return 0.0

    async def _retire(self, lora: Any) -> None:
        lid = lora.lora_int_id
        try:
            while self._running[lid] > 0:
                await asyncio.sleep(0.02)
            await self.shared.remove_adapter(lid)
            log.info("adapter %s removed (its last request finished)", lora.lora_name)
        except Exception as exc:  # noqa: BLE001 - vLLM's LRU cache drops it in time anyway
            log.warning("adapter %s not removed: %r", lora.lora_name, exc)
        finally:
            self._running.pop(lid, None)
            self.retiring.pop(lid, None)

    def _using(self, lora: Any) -> _Using:
        return _Using(self._running, lora.lora_int_id if lora is not None else 0)

    def shutdown(self) -> None:
        """The shared engine is its owner's to shut down (serving/main.py)."""


class _Using:
    """Counts a request on its adapter for as long as it runs (a context manager)."""

    def __init__(self, running: Counter[int], lid: int) -> None:
        self.running, self.lid = running, lid

    def __enter__(self) -> None:
        self.running[self.lid] += 1

    def __exit__(self, *exc: object) -> None:
        self.running[self.lid] -= 1


def _own(d: Delta) -> Delta:
    """A delta without vLLM's weight-version spans: they label the base engine's weights, while
    an adapter request ran on one version from its first token to its last."""
    return replace(d, versions=[]) if d.versions else d


def adapter_slots(shared: VllmEngine, base_dir: Path, n: int = 2) -> list[AdapterSlot]:
    """``n`` slots on ``shared`` (an engine started with ``lora``), each holding the base to start."""
    ids = itertools.count(1)  # vLLM's adapter ids start at 1; each load takes a fresh one
    return [AdapterSlot(shared, base_dir, ids, reports_stats=i == 0) for i in range(n)]
