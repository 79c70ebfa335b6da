"""Tiny random models of many Hugging Face architectures (2 layers, hidden 64, vocab 48), built
from transformers' config classes, for the architecture matrix (tests/test_arch_matrix.py).

WINDOW is shorter than the test prompts, so every sliding-window layer really drops context."""

from __future__ import annotations

import torch
import transformers as T

VOCAB, HIDDEN, WINDOW = 48, 64, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
DROP = object()  # a COMMON key the config does not take
LOCAL_GLOBAL = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])

# name -> (config class, model class, config overrides); "+window" marks a window that bites
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2+window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                             max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral+window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2+window": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, **LOCAL_GLOBAL)),
    "gemma3+window": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, **LOCAL_GLOBAL)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=DROP)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=512)),
    "mixtral+window": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                   sliding_window=WINDOW + 1)),
    "cohere2+window": ("Cohere2Config", "Cohere2ForCausalLM", LOCAL_GLOBAL),
    # attention sinks, eager only; its YaRN factor of 32 wants a 32 x 4096 context to stay quiet
    "gpt_oss+window": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                                 max_position_embeddings=32 * 4096, **LOCAL_GLOBAL)),
}
GPT2_NAMES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")  # GPT-2 calls them n_embd, n_layer, ...


def tiny(name: str, seed: int = 0, scale: float = 20.0, **overrides):
    """A random model of architecture `name` (ARCHS) in fp32 eval mode; `scale` sharpens its
    next-token distributions (the output layer is untied, so only the logits change)."""
    conf, cls, extra = ARCHS[name]
    kw = {**COMMON, **extra, **overrides}
    kw = {k: v for k, v in kw.items() if v is not DROP and not (name == "gpt2" and k in GPT2_NAMES)}
    torch.manual_seed(seed)
    model = getattr(T, cls)(getattr(T, conf)(**kw)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model
