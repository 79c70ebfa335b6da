"""Tiny random causal LMs of several families (hidden 64, 4 layers, small vocab), for the
feature head's target-layout tests and its training / export on non-Llama targets."""

from __future__ import annotations

import torch
import transformers as tf

V = 64
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
SLIDING = dict(sliding_window=8)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "mistral": lambda: tf.MistralConfig(**COMMON, **SLIDING),
    "qwen2": lambda: tf.Qwen2Config(**COMMON),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=32),
    "gemma": lambda: tf.GemmaConfig(**COMMON, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=16, **SLIDING),
    # local and global layers: full attention every 2nd layer (the 270M: every 6th)
    "gemma3": lambda: tf.Gemma3TextConfig(**COMMON, head_dim=16, **SLIDING,
                                          layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": lambda: tf.Phi3Config(**COMMON),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}),
}
REFUSED = {
    "gpt2": lambda: tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                  bos_token_id=1, eos_token_id=2),
}


def tiny_model(family: str, seed: int = 0, sharp: float = 1.0):
    """A random model of `family` in eval mode; `sharp` scales its output layer (a sharper,
    more learnable next-token distribution)."""
    torch.manual_seed(seed)
    cfg = (CONFIGS | REFUSED)[family]()
    attn = "eager" if family == "gemma2" else "sdpa"  # Gemma 2's soft-capped attention has no sdpa
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        for p in model.parameters():  # transformers' init is tiny (0.02): larger, distinct states
            if p.ndim == 2:
                p.normal_(0, 0.2)
        if sharp != 1.0:
            model.get_output_embeddings().weight.mul_(sharp)
    return model
