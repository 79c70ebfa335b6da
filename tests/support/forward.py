"""Forward helpers: the logits and cached keys of a short run of rounds, to compare two forwards of
one model bit for bit (the one-call layer and the quantized blocks)."""

import torch

from decoding.kv_cache import CachedModel
from decoding.tree import TreeLayout, layout_from_k_config


def layer_rounds(model):
    """A prefill, a 1-token step, a tree round, its commit and the next round (longer than the
    tiny models' window of 4, so sliding layers cut their front): logits and every cached key."""
    cm, lay = CachedModel(model), layout_from_k_config([2, 2, 1])
    prompt = list(range(3, 14))
    out = [cm.feed(prompt, TreeLayout(()), [], 0, 0)[0]]
    prompt.append(7)
    out.append(cm.feed(prompt, TreeLayout(()), [], 0, 0)[0])
    out.append(cm.feed(prompt, lay, [5, 6, 7, 8, 9, 10, 11], 0, 7)[0])
    cm.commit([0, 2, 5], 7)
    prompt += [5, 7, 10]
    out.append(cm.feed(prompt, lay, [1, 2, 3, 4, 5, 6, 7], 0, 7)[0])
    keys = [torch.cat([layer.keys.flatten(), layer.values.flatten()]).float() for layer in cm.cache.layers]
    return out, keys
