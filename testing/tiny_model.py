"""A tiny Llama-style model built locally (random weights, a locally trained tokenizer): no model hub needed.

Used by the tests, the vLLM example and the end-to-end benchmark to run a real engine on a machine without
network access. Building is deterministic for a given seed and size, so reruns produce identical files.
Needs ``transformers``, ``tokenizers`` and ``safetensors`` (all installed with the ``vllm`` extra).
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["WORDS", "build_tiny_llama"]

WORDS: tuple[str, ...] = tuple(
    [
        "the",
        "a",
        "an",
        "system",
        "user",
        "assistant",
        "model",
        "cache",
        "memory",
        "block",
        "token",
        "prompt",
        "answer",
        "question",
        "offload",
        "host",
        "device",
        "layer",
        "head",
        "attention",
        "value",
        "key",
        "page",
        "chunk",
        "store",
        "load",
        "evict",
        "hit",
        "miss",
        "engine",
        "request",
        "batch",
        "step",
        "worker",
        "scheduler",
        "policy",
        "prefix",
        "window",
        "tier",
        "disk",
        "network",
        "fast",
        "slow",
        "small",
        "large",
        "first",
        "last",
        "next",
        "every",
        "some",
        "none",
    ]
)
"""The words the tokenizer is trained on: text made of them is about one token per word."""


def _corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + "." for _ in range(lines)]


def build_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    weight_std: float = 0.08,
    sliding_window: int | None = None,
) -> Path:
    """Write a random-weight Llama model and a byte-level BPE tokenizer to ``path``; return the path.

    Weights are drawn from ``normal(0, weight_std)`` with a fixed seed (larger than the usual init so that
    greedy decoding is not flat). ``head_dim = hidden_size // num_heads``. With ``sliding_window`` the model is a
    Mistral (Llama with sliding-window attention over that many tokens).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, 4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)

    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if sliding_window is None else (MistralConfig, MistralForCausalLM)
    )
    extra = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = config_cls(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, weight_std)
    model.save_pretrained(out, safe_serialization=True)
    return out
