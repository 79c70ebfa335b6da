"""Whether a target and a stand-alone draft can speculate together: their vocabularies and
tokenizers must line up. A feature head is checked against its target's fingerprint instead
(decoding.drafts.io)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.models.errors import ModelError

# Strings whose token ids must agree between draft and target (code, prose, unicode, digits).
PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 42\n",
    "Ünïcödé, 数字 123456789, emojis 🙂 and    spaces\t\n",
)


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object


def check_pair(target, draft, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft that cannot speculate for this target: vocabularies must line up.

    The draft's output layer may be narrower than the target's only if every id it can
    emit means the same token; we require equal logit widths to keep verification simple.
    """
    tv = target.get_output_embeddings().weight.shape[0]
    dv = draft.get_output_embeddings().weight.shape[0]
    if tv != dv:
        raise ModelError(
            f"draft and target vocabularies differ (target {tv} logits, draft {dv}): "
            "they must share a tokenizer"
        )
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ModelError(
            "draft and target tokenizers map tokens to different token ids: they must share a tokenizer"
        )
    if len(target_tok) != len(draft_tok):
        raise ModelError(
            f"draft and target tokenizers differ in size ({len(draft_tok)} vs {len(target_tok)})"
        )
    for text in PROBE_TEXTS:
        a, b = target_tok.encode(text), draft_tok.encode(text)
        if a != b:
            raise ModelError(
                "draft and target tokenizers give different token ids on a probe string "
                f"({text[:30]!r}...): they must share a tokenizer"
            )


def small_draft_config(target_config, layers: int = 2, hidden: int = 256, heads: int = 4,
                       intermediate: int = 1024):
    """A small Llama config that shares the target's vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=getattr(target_config, "rope_theta", 10000.0), tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )
