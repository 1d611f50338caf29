"""Build a small Llama-style model and a byte-level BPE tokenizer locally (``flywheel model init``).

No model hub is reachable from where Flywheel runs its tests and demo, so the default model is
built from a config: random weights, a tokenizer trained on a synthetic corpus generated here, both
saved with ``save_pretrained`` (safetensors) into one Hugging Face directory with a Flywheel
manifest. Serving and the trainer then load it through exactly the path a user's real model
directory takes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from flywheel.checkpoints import manifest

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

#: A minimal chat format: role marker, content, end marker; generation starts after the assistant
#: marker. Kept in the tokenizer so vLLM, serving and the trainer all render prompts the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = ["the", "a", "an", "model", "user", "answer", "question", "code", "function", "value", "list", "data", "stream", "train", "reward", "accept", "reject", "edit", "test", "fast", "slow", "good", "bad", "small", "large", "first", "last", "next", "time", "step", "version", "token", "text", "line", "file", "read", "write", "call", "return", "make", "take", "give", "find", "show", "tell", "ask", "work", "run", "because", "when", "where", "which", "while", "after", "before", "under", "over", "with", "from", "into", "about", "please", "thanks", "yes", "no", "maybe", "sure", "here", "there", "this", "that", "these", "those", "it", "is", "was", "be", "are", "were", "has", "have", "had", "do", "does", "did", "can", "could", "will", "would", "should", "may", "might", "must", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "zero", "red", "green", "blue", "cat", "dog", "tree", "river", "city", "house", "light", "dark", "water", "fire", "air", "earth"]


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position: int = 512
    seed: int = 0
    dtype: str = "float32"


def synthetic_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Sentence-like lines with code, numbers and punctuation, enough for BPE merges to form."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.2:
            words.append(f"{rng.randint(0, 9999)}")
        if rng.random() < 0.15:
            words = [f"def {words[0]}({words[-1]}):", "return", *words[1:3]]
        text = " ".join(words)
        out.append(text[0].upper() + text[1:] + rng.choice(".?!"))
    return out


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with BOS/EOS/PAD and chat role tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [BOS, EOS, PAD, *ROLE_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_model(directory: Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Write a fresh model + tokenizer + manifest (version 0) into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    manifest.write(directory, manifest.build(directory, version=0, parent=None, extra={"step": 0}))
    return directory
