"""Training primitives around one DeepSpeed engine: forward/backward with a loss, step, sample, save.

An algorithm engineer drives a :class:`Policy` directly::

    policy = Policy.load(model_dir, ds_config, loss_cfg, lr=1e-5)
    out = policy.sample(prompts, max_new_tokens=16, temperature=1.0)   # torch sampling
    stats = policy.forward_backward(samples)          # loss from the registry (or loss_fn=...)
    policy.step()                                      # optimizer step (ZeRO, clipping: DeepSpeed)
    policy.publish_weights(dtype)                      # served-precision state dict

The service loop (trainer/loop.py) uses exactly these calls. Logprobs are recomputed at each
sample's sampling temperature so they are comparable with the behaviour logprobs the sampler
recorded in "processed" mode; truncation (top-p/top-k/min-p, min_tokens' mask) is not replayed, and
what remains of the gap is reported as ``trainer_logprob_gap_nats``. ZeRO stages 0-2 keep full parameters on every rank,
which :meth:`publish_weights` relies on; stage 3 would need a gather and is rejected up front.

With a :class:`LoraSpec` (``trainer.lora_rank`` above 0) the model is wrapped by PEFT before
DeepSpeed sees it: the base weights are frozen, only the adapter's A and B matrices have gradients
and optimizer state, :meth:`publish_weights` returns the adapter in PEFT's names and
:meth:`save` keeps the adapter and its optimizer state only. Logprobs, sampling and the losses go
through the wrapped model unchanged (base plus adapter), and the KL reference, unless
``reference_dir`` names another model, is the base itself with the adapter switched off: no
second copy of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.contracts import RewardEvent
from trainer.dist import any_rank
from trainer.losses import LossConfig, LossFn, LossInputs, total_loss

log = logging.getLogger(__name__)

#: Below this temperature a sampler picks the most likely token (vLLM's own threshold).
GREEDY_TEMPERATURE = 1e-5


def default_ds_config(batch_size: int, world_size: int) -> dict[str, Any]:
    """ZeRO-0, fp32, gradient clipping 1.0; the optimizer is a torch AdamW passed in."""
    micro = max(1, batch_size // world_size)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def without_aliases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor under its first name only. Models that tie their output head to
    their input embeddings (``tie_word_embeddings``: SmolLM2, Llama 3.2 1B) hold one tensor under
    two names; safetensors refuses to save shared memory, and loaders (transformers, vLLM) tie the
    head again from the config, as they do for a checkpoint ``save_pretrained`` wrote."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def check_zero_stage(ds_config: dict[str, Any]) -> None:
    """ZeRO stage 3 shards the parameters, and :meth:`Policy.publish_weights` reads them whole."""
    if ds_config.get("zero_optimization", {}).get("stage", 0) >= 3:
        raise ValueError("ZeRO stage 3 is not supported for publishing; use stage 0, 1 or 2")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA training as the ``trainer.lora_*`` settings give it (flywheel/settings.py)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, cfg: Any) -> LoraSpec | None:
        """From :class:`~flywheel.settings.TrainerSettings`; None when ``lora_rank`` is 0."""
        return cls(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_target_modules)) if cfg.lora_rank else None

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets = "all-linear" if self.target_modules == ("all-linear",) else list(self.target_modules)
        # No dropout: in train mode it would make the recomputed logprobs random, so the ratio
        # to the sampler's logprobs would measure the dropout mask, not the policy's change.
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")


class ModelRefused(ValueError):
    """A model directory the trainer could not load, and why (:func:`check_model_dir`)."""


def check_model_dir(model_dir: Path) -> None:
    """What :meth:`Policy.load` does with ``model_dir``, on the meta device: the model class
    transformers picks from the config is built without memory, and every tensor it expects must
    be in the directory's safetensors (one file or shards) with its shape, and nothing else.
    Seconds for any model size, where loading the weights would take their memory in fp32.

    A tied output head (``tie_word_embeddings``) may be absent, or stored too: loaders tie it
    again from the config. Checkpoints whose names transformers converts while loading (fused
    experts of some mixture-of-experts models) are refused here, with the names that differ.
    Raises :class:`ModelRefused`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from flywheel.checkpoints.manifest import safetensors_header

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - an unknown architecture, remote code, a bad config
        raise ModelRefused(f"transformers cannot build it: {exc}") from None
    want = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n in want}
    tied = set(want) - stored  # second names of one tensor
    held: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        held.update((k, tuple(v["shape"])) for k, v in safetensors_header(path)[0].items() if k != "__metadata__")
    problems = [
        (what, names) for what, names in (
            ("missing", sorted(set(want) - set(held) - tied)),
            ("not in the model", sorted(set(held) - set(want))),
            ("of the wrong shape", [f"{n} {list(held[n])} (the model's {list(want[n])})"
                                    for n in sorted(set(want) & set(held)) if held[n] != want[n]]),
        ) if names
    ]
    if problems:
        raise ModelRefused(f"its weights do not fit {type(model).__name__}: " + "; ".join(
            f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for what, names in problems))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] the token each position predicts
    mask: torch.Tensor  # [B, L-1] 1 where the target is a completion token
    old_logp: torch.Tensor  # [B, L-1] behaviour logprobs, aligned with targets
    temperature: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    weights: torch.Tensor  # [B]
    group_ids: list[str]

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (the engine's: rows are built on the CPU, a GPU trains)."""
        return Batch(
            **{f: getattr(self, f).to(device) for f in _TENSOR_FIELDS},
            group_ids=self.group_ids,
        )


_TENSOR_FIELDS = ("input_ids", "attention_mask", "targets", "mask", "old_logp", "temperature", "rewards", "weights")


def collate(events: Sequence[RewardEvent], pad_id: int) -> Batch:
    """Right-padded prompt+completion rows with the completion tokens' positions masked in."""
    B = len(events)
    L = max(len(e.prompt_token_ids) + len(e.completion_token_ids) for e in events)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    old = torch.zeros((B, L - 1))
    for i, e in enumerate(events):
        p, c = len(e.prompt_token_ids), len(e.completion_token_ids)
        ids[i, : p + c] = torch.tensor([*e.prompt_token_ids, *e.completion_token_ids])
        att[i, : p + c] = 1
        mask[i, p - 1 : p - 1 + c] = 1.0  # logits at position p-1 predict the first completion token
        old[i, p - 1 : p - 1 + c] = torch.tensor(e.logprobs, dtype=torch.float32)
    # Greedy samples (vLLM samples greedily below GREEDY_TEMPERATURE) are scored at temperature 1:
    # dividing the logits by 1e-300, which is 0 in float32, made every weight NaN.
    temps = torch.tensor([t if (t := e.sampling.temperature) >= GREEDY_TEMPERATURE else 1.0 for e in events])
    return Batch(
        input_ids=ids,
        attention_mask=att,
        targets=ids[:, 1:],
        mask=mask,
        old_logp=old,
        temperature=temps,
        rewards=torch.tensor([e.reward for e in events], dtype=torch.float32),
        weights=torch.tensor([e.weight for e in events], dtype=torch.float32),
        group_ids=[e.group_id for e in events],
    )


def token_logprobs(model: torch.nn.Module, b: Batch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target token (and the per-position entropy) at the sample's temperature."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
    logits = logits / b.temperature[:, None, None]
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, entropy


class Policy:
    """The trainable policy on a DeepSpeed engine plus an optional frozen reference for the KL term."""

    def __init__(self, engine: Any, tokenizer_pad: int, loss_cfg: LossConfig, reference: torch.nn.Module | None,
                 lora: LoraSpec | None = None) -> None:
        self.engine = engine
        self.pad_id = tokenizer_pad
        self.loss_cfg = loss_cfg
        self.reference = reference
        self.lora = lora
        self.steps = 0

    @classmethod
    def load(
        cls,
        model_dir: Path,
        ds_config: dict[str, Any],
        loss_cfg: LossConfig,
        *,
        lr: float,
        reference_dir: Path | None = None,
        lora: LoraSpec | None = None,
    ) -> Policy:
        from transformers import AutoConfig, AutoModelForCausalLM

        check_zero_stage(ds_config)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        pad = AutoConfig.from_pretrained(model_dir).pad_token_id
        policy = cls.on_model(model, ds_config, loss_cfg, lr=lr, lora=lora, pad_id=0 if pad is None else int(pad))
        if loss_cfg.kl_coef > 0 and (lora is None or reference_dir is not None):
            reference = AutoModelForCausalLM.from_pretrained(reference_dir or model_dir, dtype=torch.float32)
            policy.reference = reference.eval().requires_grad_(False).to(policy.device)
        return policy

    @classmethod
    def on_model(
        cls, model: torch.nn.Module, ds_config: dict[str, Any], loss_cfg: LossConfig, *, lr: float,
        lora: LoraSpec | None = None, pad_id: int = 0,
    ) -> Policy:
        """A policy on a model already in memory, as :meth:`load` builds it from there: wrapped by
        PEFT with ``lora``, then handed to DeepSpeed with a torch AdamW over the trainable
        parameters. No separate KL reference (with LoRA the base is one). bench/lora_step.py
        builds a model from a config alone and times this policy's steps."""
        import deepspeed

        check_zero_stage(ds_config)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora.peft_config())  # the base frozen, B = 0: version 0 is the base
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None if "optimizer" in ds_config else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        return cls(engine, pad_id, loss_cfg, None, lora)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        """Where the weights live (the CPU, or this rank's GPU): every batch is moved there."""
        return self.engine.device

    # ------------------------------------------------------------ primitives
    def forward_backward(self, events: Sequence[RewardEvent], loss_fn: LossFn | None = None) -> dict[str, float]:
        """One forward and backward pass; gradients accumulate until :meth:`step`.

        A loss that is not finite on any rank is not backpropagated on any (DeepSpeed's
        collectives stay in step): the stats then hold only ``nonfinite`` = 1, and the caller
        must not :meth:`step` on that batch. One NaN gradient would make every weight NaN, in
        this version and every later one.
        """
        self.engine.train()
        b = collate(events, self.pad_id).to(self.device)
        logp, entropy = token_logprobs(self.engine, b, with_entropy=True)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.reference, b, with_entropy=False)
        elif self.lora is not None and self.loss_cfg.kl_coef > 0:
            with torch.no_grad(), self.module.disable_adapter():  # the frozen base is the reference
                ref, _ = token_logprobs(self.module, b, with_entropy=False)
        inputs = LossInputs(
            logp=logp, old_logp=b.old_logp, mask=b.mask, rewards=b.rewards, group_ids=b.group_ids,
            weights=b.weights, entropy=entropy, ref_logp=ref,
        )
        loss, stats = total_loss(inputs, self.loss_cfg, loss_fn)
        if any_rank(not bool(torch.isfinite(loss.detach()))):
            return {"nonfinite": 1.0}
        self.engine.backward(loss)
        stats["tokens"] = float(b.mask.sum())
        stats["reward_mean"] = float(b.rewards.mean())
        stats["distinct_frac"] = len({tuple(e.completion_token_ids) for e in events}) / len(events)
        return stats

    def step(self) -> None:
        self.engine.step()
        self.steps += 1

    @torch.no_grad()
    def logprobs(self, events: Sequence[RewardEvent]) -> torch.Tensor:
        """Trainer logprobs of each completion token, ``[B, L-1]`` masked to zero off-completion."""
        self.engine.eval()
        b = collate(events, self.pad_id).to(self.device)
        logp, _ = token_logprobs(self.engine, b, with_entropy=False)
        return logp * b.mask

    @torch.no_grad()
    def sample(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0, eos_id: int | None = None
    ) -> list[tuple[list[int], list[float]]]:
        """Sample completions with torch (no engine): ``[(token ids, logprobs)]`` per prompt.

        Logprobs are of the distribution each token was drawn from (after temperature), the same
        "processed" convention serving records, so samples from here train like served ones.
        """
        self.engine.eval()
        model = self.module
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding keeps every row's next token at the end
            ids[i, L - len(p) :] = torch.tensor(list(p))
            att[i, L - len(p) :] = 1
        ids, att = ids.to(self.device), att.to(self.device)
        toks, lps = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        for _ in range(max_new_tokens):
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -1].float()
            logsm = torch.log_softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(logsm.exp(), 1).squeeze(-1)
            toks.append(nxt)
            lps.append(logsm.gather(-1, nxt[:, None]).squeeze(-1))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            att = torch.cat([att, (~done).long()[:, None]], dim=1)
            if eos_id is not None:
                done |= nxt == eos_id
                if bool(done.all()):
                    break
        out = []
        T, LP = torch.stack(toks, 1), torch.stack(lps, 1)
        for i in range(len(prompts)):
            t, lp = T[i].tolist(), LP[i].tolist()
            if eos_id is not None and eos_id in t:
                k = t.index(eos_id) + 1
                t, lp = t[:k], lp[:k]
            out.append((t, lp))
        return out

    def publish_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The policy's parameters in the served dtype, contiguous on the CPU (safetensors-ready),
        each stored tensor once (:func:`without_aliases`). With LoRA: the adapter's tensors only,
        named as PEFT's ``save_pretrained`` names them (what vLLM and PEFT load)."""
        if self.lora is not None:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.module)
        else:
            state = without_aliases(self.module.state_dict())
        return {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}

    def adapter_config(self, base_name: str) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` of the adapter, naming its base, for inference."""
        cfg = self.module.peft_config["default"].to_dict()
        cfg.update(base_model_name_or_path=base_name, inference_mode=True)
        # sets (target_modules, resolved from all-linear) as sorted lists, as PEFT writes them
        return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in cfg.items()}

    def save(self, directory: Path, client_state: dict[str, Any] | None = None) -> None:
        """DeepSpeed checkpoint (weights + optimizer state) under ``directory/ds``; all ranks call it.
        With LoRA the frozen base is left out: it is the model directory, checked by hash on restore."""
        self.engine.save_checkpoint(str(directory), tag="ds", client_state=client_state or {}, save_latest=False,
                                    exclude_frozen_parameters=self.lora is not None)

    def restore(self, directory: Path) -> dict[str, Any]:
        """Load weights and optimizer state saved by :meth:`save`; returns the client state."""
        # with LoRA the checkpoint holds the adapter only; the base comes from the model directory
        _, client = self.engine.load_checkpoint(str(directory), tag="ds", load_module_strict=self.lora is None)
        return client or {}
