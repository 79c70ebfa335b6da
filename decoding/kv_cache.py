"""KV-cache bookkeeping: keep the accepted path of a verified tree, drop the rest.

Works on transformers' DynamicCache with full-attention layers (tensors [B, H, T, D]).
Sliding-window layers get the same growing layers, their window applied in the mask
(decoding.models.arch); what cannot be rolled back (recurrent state, unknown caches) is refused there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.models.arch import FULL, SLIDING, AttentionPlan, attention_plan, check_cache_used


def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer that appends in place into spare room (doubled when full) instead of
        concatenating: a step writes its new rows, not the whole cache again (transformers' cat
        copies every cached key and value of every layer each step). `keys` / `values` stay views
        of the buffer, so rollback by slicing (keep_path, crop, cut_front) works unchanged."""

        kv_dtype: torch.dtype | None = None
        """Store keys and values in this dtype (float16 under a float32 model: set_kv_dtype)."""
        reserve: int = 0
        """Rows a new buffer holds at least (CachedModel.reserve)."""

        def update(self, key_states, value_states, *args, **kwargs):
            if self.kv_dtype is not None:
                key_states, value_states = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self._kb = append_kv(self.keys, getattr(self, "_kb", None), key_states, self.reserve)
            self.values, self._vb = append_kv(self.values, getattr(self, "_vb", None), value_states, self.reserve)
            return self.keys, self.values

        _span: tuple[int, int] | None = None
        """(start, length) of the views in the buffers that grown() recorded and nothing has read
        or replaced since: made into `keys` / `values` on first use (a kernel call a layer and
        request would otherwise make two views nobody reads before the next round)."""

        @property
        def keys(self):
            if self._span is not None:
                self._views()
            return self._keys

        @keys.setter
        def keys(self, t):
            if self._span is not None:
                self._views()
            self._keys = t

        @property
        def values(self):
            if self._span is not None:
                self._views()
            return self._values

        @values.setter
        def values(self, t):
            if self._span is not None:
                self._views()
            self._values = t

        def _views(self):
            start, n = self._span
            self._span = None
            self._keys, self._values = self._kb.narrow(-2, start, n), self._vb.narrow(-2, start, n)

        @property
        def rows(self) -> int:
            """Cached rows, without making the views."""
            if self._span is not None:
                return self._span[1]
            return self._keys.shape[-2] if self._keys is not None and self._keys.dim() > 1 else 0

        def cut(self, n: int) -> None:
            """Keep the first `n` cached rows."""
            if self._span is not None:
                self._span = (self._span[0], n)
            else:
                self.keys, self.values = self.keys[..., :n, :], self.values[..., :n, :]

        def room(self, like: torch.Tensor, t: int):
            """For a kernel that writes `t` new keys and values itself (like: the new keys, or
            any [B, KV, t, D] tensor of their dtype): (key buffer, value buffer, where the cached
            rows start in them, how many there are); then `grown(t)`."""
            span = self._span  # what the last grown() left, while nothing read or replaced it
            if span is not None and span[0] + span[1] + t <= self._kb.shape[-2]:
                return self._kb, self._vb, span[0], span[1]
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            self.keys, self._kb, start = _room(self.keys, getattr(self, "_kb", None), like, t, self.reserve)
            self.values, self._vb, _ = _room(self.values, getattr(self, "_vb", None), like, t, self.reserve)
            return self._kb, self._vb, start, self.keys.shape[-2] if self.keys.dim() == like.dim() else 0

        def grown(self, start: int, length: int):
            """The kernel wrote its rows: the views cover `length` rows from `start` (made when
            first read)."""
            self._span = (start, length)

    return GrowingLayer


def _room(view: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor, t: int, reserve: int = 0):
    """(view, buffer, start): a buffer holding `view` from `start` with room for `t` more rows
    after it along dim -2; `buf` itself where they fit, else a new one of twice the length, or of
    `reserve` rows where that is more (`view` copied in, returned as a view of it)."""
    n = view.shape[-2] if view.dim() == new.dim() else 0
    start = None
    if buf is not None and n and view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() \
            and view.stride() == buf.stride():
        start = (view.storage_offset() - buf.storage_offset()) // buf.stride(-2)
    if start is None or start + n + t > buf.shape[-2]:
        old = view if n else None
        buf = new.new_empty(*new.shape[:-2], max(64, 2 * (n + t), reserve), new.shape[-1])
        if old is not None:
            buf[..., :n, :].copy_(old)
        view, start = buf[..., :n, :], 0
    return view, buf, start


def append_kv(view: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor, reserve: int = 0):
    """`view` (a slice along dim -2 of `buf`, or anything else) followed by `new`, written into
    `buf` where it fits after the view; else into a new buffer of twice the length (or `reserve`)."""
    t = new.shape[-2]
    view, buf, start = _room(view, buf, new, t, reserve)
    n = view.shape[-2] if view.dim() == new.dim() else 0
    buf[..., start + n:start + n + t, :].copy_(new)
    return buf[..., start:start + n + t, :], buf


_GROWING: list = []


def new_cache(model, plan: AttentionPlan | None = None):
    """The model's DynamicCache with growing layers (appended in place, see _growing_layer_class);
    with a sliding window, growing layers in place of the rolling ones too (a rolling layer drops
    tokens a rejected tree node pushed out of its window)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if not _GROWING:
        _GROWING.append(_growing_layer_class())
    cache = DynamicCache(config=model.config)
    sliding = set(plan.sliding) if plan is not None else set()
    for i, layer in enumerate(cache.layers):
        if i in sliding or type(layer) is DynamicLayer:
            cache.layers[i] = _GROWING[0]()
            cache.layers[i].kv_dtype = kv_dtype(model)
    return cache


KV_DTYPES = ("float32", "float16")


def kv_dtype(model) -> torch.dtype | None:
    """The dtype `model`'s KV caches store, where set_kv_dtype changed it (else None: the model's)."""
    return model.__dict__.get("_specstop_kv_dtype")


def set_kv_dtype(model, dtype: str | None) -> None:
    """Store `model`'s keys and values as float16 (or back to the model's dtype: None / "float32").

    Why: a step's attention reads every cached key and value of every request; under a float32
    model that is 1.5 KB a token a layer for SmolLM2, which at a few hundred tokens x 4 requests
    outweighs the Q4_1 weights a round reads. float16 halves the bytes (llama.cpp's default KV type,
    `-ctk f16`). The math stays float32: the kernels widen each key as they read it (exactly), so
    the model's law changes only by the one rounding of each key and value, the same for every
    strategy: `ar` and speculation still agree (tests/forward/test_kv_dtype.py). Needs the lean
    forward on decoding.forward.kernels or the quantized kernels (their attention reads float16);
    a CachedModel made before the call keeps its dtype."""
    from decoding.forward.packed import forward_kind

    lean = [layer._lean for layer in getattr(getattr(model, "model", None), "layers", None) or ()
            if hasattr(layer, "_lean")]
    if dtype not in (None, *KV_DTYPES):
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)} (got {dtype!r})")
    half = dtype == "float16"
    if half and (model.dtype != torch.float32 or forward_kind(model) != "lean"
                 or not lean or not all(f["ops"] is not None for f in lean)):
        raise ValueError("a float16 KV cache needs a float32 model on the lean forward with its CPU kernels "
                         f"(this one: {str(model.dtype).removeprefix('torch.')}, {forward_kind(model)} forward)")
    model.__dict__["_specstop_kv_dtype"] = torch.float16 if half else None
    for f in lean:
        if "kv_like" in f:  # what the one-call layer's cache buffers are made like
            f["kv_like"] = f["kv_like"].new_empty(f["kv_like"].shape, dtype=torch.float16 if half else model.dtype)


def _layers(cache):
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, *_GROWING):
            raise TypeError(
                f"tree speculation needs full-attention KV caches; got {type(layer).__name__}"
            )
    return cache.layers


def cache_len(cache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def keep_path(cache, start: int, path: Sequence[int], fed: int, front: Sequence[int] | None = None) -> int:
    """Keep cache[:start] and the entries of tree nodes `path` (offsets from `start`).

    Only nodes with offset < `fed` are in the cache; since a path goes down the tree in BFS
    order, those are a prefix of it. `front[i]`: tokens cut from the front of layer i (a
    sliding layer, see `CachedModel.commit`). Returns the new cache length.
    """
    kept = [i for i in path if i < fed]
    layers = _layers(cache)
    if kept and not any(front or ()) and _keep_in_place(layers, start, kept):
        return start + len(kept)
    for n, layer in enumerate(layers):
        if not layer.is_initialized:
            continue
        s = start - front[n] if front else start
        if not kept and hasattr(layer, "cut"):  # a growing layer: no view made (a plain round)
            if layer.rows != s:
                layer.cut(s)
            continue
        if not kept and layer.keys.shape[-2] == s:  # nothing to move or cut (a plain round)
            continue
        if kept:
            idx = torch.tensor(kept, device=layer.keys.device) + s
            # advanced indexing copies first, so the in-place write cannot alias its source
            layer.keys[..., s : s + len(kept), :] = layer.keys[..., idx, :]
            layer.values[..., s : s + len(kept), :] = layer.values[..., idx, :]
        layer.keys = layer.keys[..., : s + len(kept), :]
        layer.values = layer.values[..., : s + len(kept), :]
    return start + len(kept)


_KEEP_ROWS = []


def _keep_rows_op():
    """csrc/segments.h keep_rows from whichever kernel library is loaded (None: neither)."""
    if not _KEEP_ROWS:
        for ns in ("specstop", "specstop_quant"):
            try:
                _KEEP_ROWS.append(getattr(torch.ops, ns).keep_rows)
                break
            except (AttributeError, RuntimeError):
                continue
    return _KEEP_ROWS[0] if _KEEP_ROWS else None


def _keep_in_place(layers, start: int, kept: list[int]) -> bool:
    """keep_path's row moves for every layer in ONE kernel call, where every layer is a growing
    layer whose rows a kernel wrote and nothing has viewed since (the lean forward's rounds);
    False (nothing done) otherwise."""
    if not all(getattr(layer, "_span", None) is not None for layer in layers):
        return False
    op = _keep_rows_op()
    if op is None:
        return False
    op([layer._kb for layer in layers], [layer._vb for layer in layers],
       [layer._span[0] for layer in layers], start, kept)
    for layer in layers:
        layer._span = (layer._span[0], start + len(kept))
    return True


def cut_front(cache, layers: Sequence[int], n: int) -> None:
    """Drop the `n` oldest entries of `layers` (a view: the memory goes at the next append)."""
    for i in layers:
        layer = cache.layers[i]
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., n:, :], layer.values[..., n:, :]


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


def windowed(rows: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """`rows` restricted to a sliding window: a query at position P keeps keys at positions
    > P - window (transformers' sliding_window_overlay, by position, so tree nodes too)."""
    return rows & ((qpos[:, None] - kpos[None, :]) < window)


class CachedModel:
    """A causal LM plus its KV cache and how many committed tokens that cache holds.

    Each round feeds the committed tokens the cache has not seen yet ("pending", causal)
    together with tree nodes (tree mask), then `commit` keeps only the accepted path.
    """

    def __init__(self, model):
        self.model = model
        self.plan = attention_plan(model)  # refuses what cannot be rolled back, before any forward
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model, self.plan)
        self.length = 0  # committed tokens held by the cache; tree nodes of this round follow
        self.cut = 0  # oldest tokens dropped from the sliding layers (outside every future window)
        self.reserve(getattr(self, "reserved", 0))

    def reserve(self, tokens: int) -> None:
        """Size the cache's buffers for `tokens` entries when they are first made (a request's
        prompt, its new tokens and a tree), instead of doubling as it grows.

        Why: a doubling copies every cached key and value into fresh memory in one round; beside a
        2,000-token prompt that round took 2-3x its neighbours, the running streams' worst
        inter-token gaps. The memory is only reserved: pages are touched as entries are written,
        so an unused reservation costs no resident memory. Past `tokens`, buffers double again."""
        self.reserved = max(0, int(tokens))
        for layer in self.cache.layers:
            if hasattr(layer, "reserve"):
                layer.reserve = self.reserved

    @torch.inference_mode()
    def feed(self, committed: Sequence[int], layout, node_tokens: Sequence[int], start: int, end: int,
             hidden: bool = False):
        """Feed pending committed tokens and tree nodes start..end-1.

        Returns logits (float, [rows, V]) for the last pending token (if any) and for each
        fed node, plus the matching last-layer hidden states when `hidden` is set.
        """
        from decoding.tree import attention_rows

        pending = list(committed[self.length :])
        n_new = end - start
        anchor = len(committed) - 1
        dev = self.model.device
        ids = torch.tensor([pending + list(node_tokens)], device=dev)
        pos = torch.arange(self.length, len(committed), device=dev)
        if n_new:
            pos = torch.cat([pos, anchor + layout.depth_ids[start:end].to(dev)])
        if self.plan.window is not None:
            mask = self._window_masks(len(committed), layout, start, end)
        elif n_new:
            rows = attention_rows(self.length, len(pending), layout.mask, start, end)
            mask = additive_mask(rows, self.model.dtype, dev)
        else:  # plain causal step: let transformers build its fast default mask
            mask = None
        first = self.length == 0
        out = self.model(
            input_ids=ids,
            position_ids=pos[None],
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=n_new + (1 if pending else 0),
            output_hidden_states=hidden,
        )
        if first:
            check_cache_used(self.model, self.cache, len(pending) + n_new, out.past_key_values)
        self.length = len(committed)
        h = out.hidden_states[-1][0, -(n_new + (1 if pending else 0)):] if hidden else None
        return out.logits[0].float(), h

    def _window_masks(self, committed: int, layout, start: int, end: int):
        """Masks of a model with sliding layers: the tree (or causal) rows, windowed for the
        sliding layers; a dict keyed by layer type when full layers need the plain rows."""
        from decoding.tree import attention_rows

        pending = committed - self.length
        rows = attention_rows(self.length, pending, layout.mask, start, end)
        anchor = committed - 1
        qpos = torch.cat([torch.arange(self.length, committed), anchor + layout.depth_ids[start:end]])
        kpos = torch.cat([torch.arange(committed), anchor + layout.depth_ids[:end]])
        dt, dev = self.model.dtype, self.model.device
        c = self.cut  # the sliding layers' cache starts at position c
        sliding = additive_mask(windowed(rows[:, c:], qpos, kpos[c:], self.plan.window), dt, dev)
        if not self.plan.hybrid:
            return sliding
        return {FULL: additive_mask(rows, dt, dev), SLIDING: sliding}

    def commit(self, path: Sequence[int], fed: int) -> None:
        """Keep the accepted tree nodes that were fed this round; drop every other node.
        Sliding layers then keep the last window - 1 committed tokens (as transformers' rolling
        layers do): the next query, at position >= length, sees nothing older."""
        if self.plan.window is None:
            self.length = keep_path(self.cache, self.length, path, fed)
            return
        front = [self.cut if i in self.plan.sliding else 0 for i in range(len(self.cache.layers))]
        self.length = keep_path(self.cache, self.length, path, fed, front)
        drop = max(0, self.length - self.plan.window + 1) - self.cut
        if drop > 0:
            cut_front(self.cache, self.plan.sliding, drop)
            self.cut += drop
