"""KV-cache bookkeeping: keep the accepted path of a verified tree, drop the rest.

Works on transformers' DynamicCache (full-attention layers, tensors [B, H, T, D]). Sliding
window and recurrent layers cannot be rolled back to an arbitrary tree path, so they are
refused with a clear error rather than silently corrupting the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _layers(cache):
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"tree speculation needs full-attention KV caches; got {type(layer).__name__}"
            )
    return cache.layers


def cache_len(cache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def keep_path(cache, start: int, path: Sequence[int], fed: int) -> int:
    """Keep cache[:start] and the entries of tree nodes `path` (offsets from `start`).

    Only nodes with offset < `fed` are in the cache; since a path goes down the tree in BFS
    order, those are a prefix of it. Returns the new cache length.
    """
    kept = [i for i in path if i < fed]
    for layer in _layers(cache):
        if not layer.is_initialized:
            continue
        if kept:
            idx = torch.tensor(kept, device=layer.keys.device) + start
            # advanced indexing copies first, so the in-place write cannot alias its source
            layer.keys[..., start : start + len(kept), :] = layer.keys[..., idx, :]
            layer.values[..., start : start + len(kept), :] = layer.values[..., idx, :]
        layer.keys = layer.keys[..., : start + len(kept), :]
        layer.values = layer.values[..., : start + len(kept), :]
    return start + len(kept)


def crop(cache, length: int) -> None:
    """Cut the cache back to `length` tokens (DynamicCache.crop takes a negative count)."""
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool [R, C] -> float [1, 1, R, C] with 0 where attended and the dtype's min elsewhere.

    Float masks are what both the eager and the sdpa attention paths of transformers add.
    """
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    out.masked_fill_(~mask.to(device), torch.finfo(dtype).min)
    return out[None, None]


class CachedModel:
    """A causal LM plus its KV cache and how many committed tokens that cache holds.

    Each round feeds the committed tokens the cache has not seen yet ("pending", causal)
    together with tree nodes (tree mask), then `commit` keeps only the accepted path.
    """

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.length = 0  # committed tokens held by the cache; tree nodes of this round follow

    @torch.inference_mode()
    def feed(self, committed: Sequence[int], layout, node_tokens: Sequence[int], start: int, end: int,
             hidden: bool = False):
        """Feed pending committed tokens and tree nodes start..end-1.

        Returns logits (float, [rows, V]) for the last pending token (if any) and for each
        fed node, plus the matching last-layer hidden states when `hidden` is set.
        """
        from .tree import attention_rows

        pending = list(committed[self.length :])
        n_new = end - start
        anchor = len(committed) - 1
        dev = self.model.device
        ids = torch.tensor([pending + list(node_tokens)], device=dev)
        pos = torch.arange(self.length, len(committed), device=dev)
        if n_new:
            pos = torch.cat([pos, anchor + layout.depth_ids[start:end].to(dev)])
            rows = attention_rows(self.length, len(pending), layout.mask, start, end)
            mask = additive_mask(rows, self.model.dtype, dev)
        else:  # plain causal step: let transformers build its fast default mask
            mask = None
        out = self.model(
            input_ids=ids,
            position_ids=pos[None],
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=n_new + (1 if pending else 0),
            output_hidden_states=hidden,
        )
        self.length = len(committed)
        h = out.hidden_states[-1][0, -(n_new + (1 if pending else 0)):] if hidden else None
        return out.logits[0].float(), h

    def commit(self, path: Sequence[int], fed: int) -> None:
        """Keep the accepted tree nodes that were fed this round; drop every other node."""
        self.length = keep_path(self.cache, self.length, path, fed)
