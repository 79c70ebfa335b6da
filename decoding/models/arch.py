"""Which architectures tree verification can serve, and how each of their layers attends.

A round feeds many candidate continuations in one forward under a custom attention mask, then
keeps only the accepted path in the KV cache. Every layer's state must therefore be per-token
keys and values that can be cut and re-ordered:

- full attention (Llama, Qwen, Phi, GPT-2, GPT-NeoX, Mixtral, ...): as it is;
- sliding-window attention (Mistral; the local layers of Gemma 2 / 3, Cohere 2, gpt-oss, Qwen2
  with use_sliding_window): transformers keeps only the last window - 1 tokens of such a
  layer, which a rejected tree node would push out for good. These layers get a plain growing
  cache instead, and the window is applied in the mask (a query at position P sees keys at
  positions > P - window, tree ancestors included), so rollback stays a crop and every output
  equals plain decoding. Once a round is committed the tokens that fell out of every future
  window are cut, so between rounds such a layer holds what transformers' rolling layer holds
  (the last window - 1 tokens); during a round it holds those plus the tree.

Refused before generation, in one line (ModelError): recurrent / SSM / linear-attention state
(Mamba, RWKV, Jamba, Qwen3-Next, ...), chunked attention, KV sharing across layers,
bidirectional attention, sliding windows of different sizes, and any cache layer we do not know.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from decoding.models.errors import ModelError

FULL, SLIDING = "full_attention", "sliding_attention"
ROLLBACK = "cannot be rolled back to the accepted tokens of a round"
_WHY = {
    "linear_attention": f"its recurrent (linear-attention / SSM) state {ROLLBACK}",
    "conv": f"its recurrent convolution state {ROLLBACK}",
    "hybrid": f"its recurrent (linear-attention) state {ROLLBACK}",
    "hybrid_sliding": f"its recurrent (linear-attention) state {ROLLBACK}",
    "chunked_attention": "chunked attention is not supported",
    "dummy": "layers without a KV cache of their own (KV sharing or attention-free layers) are not supported",
}


@dataclass(frozen=True)
class AttentionPlan:
    """How the mask of a verification forward is built for one model."""

    window: int | None = None
    """Sliding window of the sliding layers (a query at position P sees keys at positions
    > P - window); None: every layer attends to the whole context."""
    hybrid: bool = False
    """Both kinds of layers: the forward gets one mask per layer type, as a dict."""
    sliding: tuple[int, ...] = ()
    """Indices of the sliding layers."""


def arch_name(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def refuse(model, why: str) -> ModelError:
    return ModelError(f"{arch_name(model)} ({type(model).__name__}) cannot be used for tree speculation: {why}")


def attention_plan(model) -> AttentionPlan:
    """The model's plan, or a ModelError naming the architecture and what cannot be rolled back."""
    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "use_bidirectional_attention", False):
        raise ModelError(f"{arch_name(model)} ({type(model).__name__}) is not a causal decoder-only "
                         f"language model: tree speculation needs one")
    try:
        types, kwargs = _layer_types(cfg)
    except Exception as e:  # a config transformers cannot describe: we cannot either
        raise refuse(model, f"its cache layout is unknown ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise refuse(model, _WHY.get(unknown[0], f"cache layers of type {unknown[0]!r} are unknown"))
    windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == SLIDING}
    if not windows:
        return AttentionPlan()
    if len(windows) > 1 or not all(isinstance(w, int) and w > 0 for w in windows):
        raise refuse(model, f"sliding windows of several sizes ({sorted(windows, key=str)}) are not supported")
    hybrid = FULL in types
    if hybrid and not _takes_mask_per_layer_type(model):
        raise refuse(model, "it has full and sliding layers, but its forward takes one attention mask for both")
    return AttentionPlan(window=windows.pop(), hybrid=hybrid,
                         sliding=tuple(i for i, t in enumerate(types) if t == SLIDING))


def _layer_types(cfg) -> tuple[list[str], list[dict]]:
    """Each layer's cache type and its arguments, as transformers' DynamicCache reads them."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers 5 before 5.16: the same inference, for attention layers
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None) or [SLIDING if window else FULL] * cfg.num_hidden_layers
        return list(types), [{"sliding_window": window} if t == SLIDING else {} for t in types]
    return get_layer_types_and_kwargs(cfg)


def _takes_mask_per_layer_type(model) -> bool:
    """transformers' hybrid decoders take `attention_mask` as a dict keyed by layer type (the
    mapping `generate` prepares); one that does not would get the full mask on its local layers."""
    try:
        src = inspect.getsource(type(model.base_model).forward)
    except (OSError, TypeError, AttributeError):
        return False
    return re.search(r"isinstance\([^)]*attention_mask[^)]*,\s*dict\)", src) is not None


def check_cache_used(model, cache, fed: int, returned) -> None:
    """After a model's first forward: every layer holds `fed` entries of the cache it was given
    (a model keeping state elsewhere could not be rolled back)."""
    lengths = {layer.get_seq_length() for layer in cache.layers}
    if returned is not cache or lengths != {fed}:
        raise refuse(model, f"it keeps state outside the KV cache it is given, which {ROLLBACK}")
