"""The tests' tiny random models, all from one builder (`build`): seed, construct, optionally
redraw the weight matrices, sharpen the output layer. Three presets on it:

- `tiny_llama`: a small Llama (vocab <= 64, 1-4 layers) for the engine's own tests, and
  `noisy_copy` for a draft that agrees with it often but not always;
- `tiny` with `ARCHS`: the architecture matrix (2 layers, hidden 64, vocab 48;
  tests/decoding/test_greedy_on_every_architecture.py). WINDOW is shorter than the test prompts,
  so every sliding-window layer really drops context;
- `tiny_model` with `CONFIGS` / `REFUSED`: the families a feature head supports (hidden 64, 4
  layers, vocab 64, weights redrawn N(0, 0.2)), for the head's target-layout, training and export
  tests on non-Llama targets.

`save_tiny` writes a model with a word-level tokenizer over `WORDS` as a model directory."""

from __future__ import annotations

import copy

import torch
import transformers as T

# ---- the one builder ---------------------------------------------------------------------------


def build(cfg, model_cls=None, *, seed: int = 0, scale: float = 1.0, std: float | None = None,
          attn: str | None = None):
    """A random model of config `cfg` in eval mode. `model_cls` constructs it directly; without
    one, transformers' auto class builds it in fp32 with attention `attn`. `std` redraws every
    weight matrix N(0, std) (transformers' init is tiny, 0.02: larger, distinct states); `scale`
    multiplies the output layer (sharper next-token distributions; only the logits change where
    the output layer is untied)."""
    torch.manual_seed(seed)
    if model_cls is not None:
        model = model_cls(cfg).eval()
    else:
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        if std is not None:
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0, std)
        if scale != 1.0:
            model.get_output_embeddings().weight.mul_(scale)
    return model


def noisy_copy(model, noise, seed=1):
    """A draft that agrees with the target often but not always."""
    torch.manual_seed(seed)
    d = copy.deepcopy(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * noise)
    return d


# ---- a small Llama -----------------------------------------------------------------------------


def tiny_llama(seed=0, vocab=32, layers=2, hidden=32, scale=1.0, max_pos=256):
    """A random Llama; `scale` sharpens its next-token distributions."""
    cfg = T.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_pos, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return build(cfg, T.LlamaForCausalLM, seed=seed, scale=scale)


WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]


def save_tiny(path, words, model):
    """`model` and a whitespace word-level tokenizer over `words` saved as a model directory."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


# ---- the architecture matrix -------------------------------------------------------------------

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
    return build(getattr(T, conf)(**kw), getattr(T, cls), seed=seed, scale=scale)


# ---- the feature head's families ---------------------------------------------------------------

FAMILY_VOCAB = 64
FAMILY_COMMON = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
SLIDING = dict(sliding_window=8)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**FAMILY_COMMON, tie_word_embeddings=False),
    "mistral": lambda: T.MistralConfig(**FAMILY_COMMON, **SLIDING),
    "qwen2": lambda: T.Qwen2Config(**FAMILY_COMMON),
    "qwen3": lambda: T.Qwen3Config(**FAMILY_COMMON, head_dim=32),
    "gemma": lambda: T.GemmaConfig(**FAMILY_COMMON, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**FAMILY_COMMON, head_dim=16, **SLIDING),
    # local and global layers: full attention every 2nd layer (the 270M: every 6th)
    "gemma3": lambda: T.Gemma3TextConfig(**FAMILY_COMMON, head_dim=16, **SLIDING,
                                         layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": lambda: T.Phi3Config(**FAMILY_COMMON),
    "mixtral": lambda: T.MixtralConfig(**FAMILY_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "gpt_neox": lambda: T.GPTNeoXConfig(**{k: v for k, v in FAMILY_COMMON.items() if k != "num_key_value_heads"}),
}
REFUSED = {
    "gpt2": lambda: T.GPT2Config(vocab_size=FAMILY_VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                 bos_token_id=1, eos_token_id=2),
}


def tiny_model(family: str, seed: int = 0, sharp: float = 1.0):
    """A random model of `family` (CONFIGS, REFUSED) in eval mode; `sharp` scales its output
    layer (a sharper, more learnable next-token distribution)."""
    attn = "eager" if family == "gemma2" else "sdpa"  # Gemma 2's soft-capped attention has no sdpa
    return build((CONFIGS | REFUSED)[family](), seed=seed, scale=sharp, std=0.2, attn=attn)
