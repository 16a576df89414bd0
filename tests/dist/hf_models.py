"""Tiny transformers checkpoints for the `--model hf:DIR` tests: one per family
(Llama, GPT-2, Qwen2 with a tied head), 4 layers, hidden 32, vocabulary 128."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "gpt2", "qwen2")
VOCAB = 128


def config(family: str, layers: int = 4):
    """The small config of `family` (dropout off: runs compare bit for bit)."""
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=layers,
                  hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=VOCAB,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


def write(root: Path, family: str, weights: bool = True, layers: int = 4) -> Path:
    """`root/family` in save_pretrained's layout, with weights from seed 7 or
    (weights=False) its config only."""
    import transformers

    out = root / (family if weights else f"{family}-config")
    cfg = config(family, layers)
    if weights:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out
