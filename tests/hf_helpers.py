"""A Hugging Face directory as real models ship: sharded safetensors with their index, tied
embeddings, a tokenizer with its chat template. Built locally from the tiny model's spec
(flywheel/modelinit.py), with ``save_pretrained(max_shard_size=...)`` splitting it into shards;
nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

#: About 1.4 MB of fp32 weights at this size: six shards.
SHARD_SIZE = "300KB"


def build_sharded_hf_dir(directory: Path, *, seed: int = 0) -> Path:
    """A tied-embedding Llama in shards, plus tokenizer and chat template; no Flywheel manifest."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flywheel.modelinit import ModelSpec, build_tokenizer

    spec = ModelSpec(seed=seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, two names
    model.save_pretrained(directory, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(directory)
    return directory


def shards(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("model-*-of-*.safetensors"))
