"""A target (or draft) over a preallocated KV cache with bucketed forward sizes: the shape-static
forward that CUDA graphs can capture (`--forward graph`), and the same path without capture on
any device (`--forward static`), which is how the CPU proves it equals the dynamic cache.

Why: a 30-layer 135M model on a GPU is launch-bound (hundreds of small kernels a forward). A CUDA
graph replays them in one launch, but it needs every shape and address fixed: so the cache is one
buffer per layer of `capacity` slots (plus grown by doubling, which drops the graphs), a forward
of r rows runs in the smallest bucket B >= r (BUCKETS; padded rows write scratch slots no real row
sees) over the first C columns (a power of two >= the slots in use), and the ids, positions, slots
and additive mask are static input buffers refilled before each replay. Forwards larger than the
largest bucket (a prompt) run eagerly on the same cache.

Rollback is as in decoding.kv_cache: the accepted nodes' rows move down to follow the committed
ones; rows past the committed length are stale and masked. Sliding windows are applied in the mask
by position (nothing is cut: the cache keeps every token). A feature head reads the target's layer
inputs: under `capture_aux` the layers' inputs are tapped (kept by reference, so a replay refreshes
them) and handed to the capture with the padded rows cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.kv_cache import CachedModel, additive_mask, windowed
from decoding.models.arch import FULL, SLIDING

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Forward sizes (rows: pending tokens + tree nodes) that get a graph; larger forwards run eagerly."""
MIN_COLS = 128
"""Fewest cache columns a bucketed forward attends over (then 256, 512, ...)."""
START_CAPACITY = 1024
"""Slots allocated at the first forward (more when the prompt needs them; doubled when full)."""
STATIC_KINDS = ("static", "graph")
"""Forward kinds (decoding.forward.packed.forward_kind) that run on this cache."""


def bucket(rows: int) -> int | None:
    return next((b for b in BUCKETS if b >= rows), None)


def columns(need: int, capacity: int) -> int:
    c = MIN_COLS
    while c < need:
        c *= 2
    return min(c, capacity)


def cached_model(model):
    """The engine's cache for `model`: this static one where its forward kind asks for it
    (set_forward(model, "static" | "graph")), else decoding.kv_cache.CachedModel."""
    kind = getattr(model, "_specstop_forward", "eager")
    return StaticCachedModel(model, capture=kind == "graph") if kind in STATIC_KINDS else CachedModel(model)


class _Where:
    """What the layers of one forward read: the slots it writes and how many columns it sees
    (shared by every layer of one cache; the committed length answers get_seq_length)."""

    def __init__(self):
        self.slots: torch.Tensor | None = None
        self.cols = self.capacity = self.length = 0


def _slot_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        """One layer's keys and values in a fixed buffer: `update` writes the forward's rows at
        `where.slots` and returns the first `where.cols` slots (views of the buffer)."""

        def __init__(self, where: _Where):
            super().__init__()
            self.where = where
            self.buf_k = self.buf_v = None
            self.writes = 0

        def allocate(self, like: torch.Tensor, capacity: int) -> None:
            """Buffers of `capacity` slots shaped like `like` [B, KV, t, D], rows kept."""
            k = like.new_zeros(*like.shape[:2], capacity, like.shape[-1])
            v = like.new_zeros(*like.shape[:2], capacity, self._vdim or like.shape[-1])
            if self.buf_k is not None:
                n = min(self.buf_k.shape[2], capacity)
                k[:, :, :n].copy_(self.buf_k[:, :, :n])
                v[:, :, :n].copy_(self.buf_v[:, :, :n])
            self.buf_k, self.buf_v = k, v
            self.keys, self.values = k, v
            self.is_initialized = True

        _vdim = None

        def update(self, key_states, value_states, *args, **kwargs):
            if self.buf_k is None:
                self._vdim = value_states.shape[-1]
                self.allocate(key_states, self.where.capacity)
            self.buf_k.index_copy_(2, self.where.slots, key_states)
            self.buf_v.index_copy_(2, self.where.slots, value_states)
            self.writes = 1  # a flag, not a count: a count would change every call of a traced round
            c = self.where.cols
            return self.buf_k[:, :, :c], self.buf_v[:, :, :c]

        def get_seq_length(self) -> int:
            return self.where.length

    return SlotLayer


_SLOT: list = []


@dataclass
class _Inputs:
    """Static input buffers of one bucket (device tensors refilled before each call)."""

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    masks: dict = field(default_factory=dict)
    """layer type (or None: one mask for all) -> additive mask [1, 1, B, capacity]."""


@dataclass
class _Graph:
    graph: object
    logits: torch.Tensor
    hidden: torch.Tensor | None
    taps: dict


class StaticCachedModel(CachedModel):
    """CachedModel's contract (feed / commit / reset / length) on a static, bucketed cache; with
    `capture`, each (bucket, columns, hidden) forward is captured once as a CUDA graph and replayed."""

    def __init__(self, model, capture: bool = False):
        if capture and next(model.parameters()).device.type != "cuda":
            raise ValueError("the graph forward needs a CUDA device (use --forward static for the same cache "
                             "without graphs)")
        self.capture = capture
        self.capacity = 0
        self.graphs: dict[tuple, _Graph] = {}
        self.inputs: dict[int, _Inputs] = {}
        self.pool = None
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tap_hooks: list = []
        self.taps: dict[int, torch.Tensor] = {}
        self.tapping = False
        super().__init__(model)

    def reset(self) -> None:
        """A new sequence: the buffers (and graphs) stay; their rows are stale and masked."""
        if not _SLOT:
            _SLOT.append(_slot_layer_class())
        if not hasattr(self, "where"):
            from transformers import DynamicCache

            self.where = _Where()
            self.cache = DynamicCache(config=self.model.config)
            self.cache.layers = [_SLOT[0](self.where) for _ in self.cache.layers]
            self.checked = False
        self.length = self.where.length = 0
        self.nodes = 0  # tree nodes fed this round (slots after the committed ones)
        self.cut = 0

    # -- the forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def feed(self, committed, layout, node_tokens: Sequence[int], start: int, end: int, hidden: bool = False):
        from decoding.tree import attention_rows

        pending = list(committed[self.length:])
        n_new, p = end - start, len(pending)
        rows = p + n_new
        if p and self.nodes:
            raise RuntimeError("committed tokens fed after tree nodes of the same round")
        base = self.length + self.nodes  # slots in use
        anchor = len(committed) - 1
        qpos = torch.arange(self.length, len(committed))
        if n_new:
            qpos = torch.cat([qpos, anchor + layout.depth_ids[start:end]])
        seen = attention_rows(self.length, p, layout.mask, start, end)  # [rows, base + rows]
        masks = {None: seen}
        if self.plan.window is not None:
            kpos = torch.cat([torch.arange(len(committed)), anchor + layout.depth_ids[:end]])[:base + rows]
            slid = windowed(seen, qpos, kpos, self.plan.window)
            masks = {FULL: seen, SLIDING: slid} if self.plan.hybrid else {None: slid}
        b = bucket(rows)
        self._tap_if_captured()
        if b is None:
            logits, h = self._eager(pending + list(node_tokens), qpos, base, masks, hidden)
        else:
            logits, h = self._bucketed(b, pending + list(node_tokens), qpos, base, masks, hidden)
        if not self.checked:  # every layer wrote into the cache it was given
            self._check(rows)
            self._stack()
        self.length = self.where.length = len(committed)
        self.nodes = end
        keep = slice(rows - n_new - (1 if p else 0), rows)  # the last pending token and the nodes
        return logits[keep].to(torch.float32, copy=True), (h[keep].clone() if hidden else None)

    def _check(self, fed: int) -> None:
        from decoding.models.arch import ROLLBACK, refuse

        if any(layer.writes == 0 for layer in self.cache.layers):
            raise refuse(self.model, f"it keeps state outside the KV cache it is given, which {ROLLBACK}")
        self.checked = True

    def _ensure(self, need: int) -> None:
        """Room for `need` slots (plus a bucket of scratch): allocate or double, dropping graphs."""
        if need <= self.capacity:
            return
        cap = max(START_CAPACITY, self.capacity)
        while cap < need:
            cap *= 2
        self.capacity = self.where.capacity = cap
        # the old graphs' pool keeps blocks that outlive them (taps, a caller's logits): new graphs
        # get a new pool (capturing into a pool whose graphs are gone fails inside the allocator)
        self.graphs, self.inputs, self.taps, self.pool = {}, {}, {}, None
        for layer in self.cache.layers:
            if layer.buf_k is not None:
                layer.allocate(layer.buf_k, cap)
        if self.stacked is not None:
            self.stacked = None
            self._stack()

    def _stack(self) -> None:
        """One buffer for every layer's keys and one for their values (each layer's a view),
        where their shapes agree: a rollback is then one gather and one copy per buffer instead of
        two per layer, each a kernel launch on a GPU. Graphs captured before read the old buffers:
        dropped."""
        layers = self.cache.layers
        if self.stacked is not None or len(layers) < 2 or any(x.buf_k is None for x in layers):
            return
        if len({(x.buf_k.shape, x.buf_v.shape, x.buf_k.dtype) for x in layers}) > 1:
            return
        k, v = torch.stack([x.buf_k for x in layers]), torch.stack([x.buf_v for x in layers])
        for i, x in enumerate(layers):
            x.buf_k = x.keys = k[i]
            x.buf_v = x.values = v[i]
        self.stacked, self.graphs = (k, v), {}

    def _run(self, ids, pos, slots, cols, masks, hidden):
        self.where.slots, self.where.cols = slots, cols
        mask = {k: m[..., :cols] for k, m in masks.items()}
        self.tapping = True
        try:
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask.get(None, mask),
                             past_key_values=self.cache, use_cache=True, output_hidden_states=hidden)
        finally:
            self.tapping = False
        return out.logits[0], (out.hidden_states[-1][0] if hidden else None)

    def _eager(self, tokens, qpos, base, masks, hidden):
        """A forward of any size (the prompt), on the same cache, uncaptured."""
        rows = len(tokens)
        self._ensure(base + rows + BUCKETS[-1])
        dev, dt = self.model.device, self.model.dtype
        cols = base + rows
        add = {k: additive_mask(m, dt, dev) for k, m in masks.items()}
        slots = torch.arange(base, base + rows, device=dev)
        out = self._run(torch.tensor([tokens], device=dev), qpos[None].to(dev), slots, cols, add, hidden)
        self._publish(self.taps, rows)
        return out

    def _bucketed(self, b, tokens, qpos, base, masks, hidden):
        rows = len(tokens)
        self._ensure(base + b + BUCKETS[-1])
        cols = columns(base + b, self.capacity)
        x = self._inputs(b, list(masks))
        pad = b - rows
        dev = self.model.device
        ids = torch.tensor(tokens + [0] * pad)
        pos = torch.cat([qpos, qpos[-1:].expand(pad)])
        slots = torch.arange(base, base + b)  # padded rows write scratch slots after the real ones
        x.ids[0].copy_(ids.to(dev), non_blocking=True)
        x.pos[0].copy_(pos.to(dev), non_blocking=True)
        x.slots.copy_(slots.to(dev), non_blocking=True)
        for k, m in masks.items():
            seen = torch.zeros(b, cols, dtype=torch.bool)
            seen[:rows, :m.shape[1]] = m
            seen[torch.arange(rows, b), slots[rows:]] = True  # a padded row sees only itself
            x.masks[k][0, 0, :, :cols].copy_(additive_mask(seen, self.model.dtype, "cpu")[0, 0].to(dev))
        if not self.capture:
            out = self._run(x.ids, x.pos, x.slots, cols, x.masks, hidden)
            self._publish(self.taps, rows)
            return out
        key = (b, cols, hidden)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(x, cols, hidden)
        g.graph.replay()
        self._publish(g.taps, rows)
        return g.logits, g.hidden

    def _inputs(self, b: int, kinds) -> _Inputs:
        x = self.inputs.get(b)
        if x is None:
            dev, dt = self.model.device, self.model.dtype
            x = self.inputs[b] = _Inputs(torch.zeros(1, b, dtype=torch.long, device=dev),
                                         torch.zeros(1, b, dtype=torch.long, device=dev),
                                         torch.zeros(b, dtype=torch.long, device=dev))
            for k in kinds:
                x.masks[k] = torch.zeros(1, 1, b, self.capacity, dtype=dt, device=dev)
        return x

    def _capture(self, x: _Inputs, cols: int, hidden: bool) -> _Graph:
        """Warm up on a side stream (the cache writes there are the replay's own), then capture."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run(x.ids, x.pos, x.slots, cols, x.masks, hidden)
        torch.cuda.current_stream().wait_stream(s)
        self._stack()  # the warm-up allocated every layer: stack before any graph holds their addresses
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, h = self._run(x.ids, x.pos, x.slots, cols, x.masks, hidden)
        return _Graph(graph, logits, h, dict(self.taps))

    @torch.inference_mode()
    def precapture(self, max_cols: int, taps: bool = False, hidden: bool = False) -> int:
        """Capture every bucket's graph up to `max_cols` columns now (a benchmark's warm-up: no
        capture inside a timed run); `taps` for a target a feature head reads. The capture's
        writes land in slots a sequence overwrites before it reads them. Returns the graphs held."""
        if not self.capture:
            return 0
        if taps:
            self._install_taps()
        self._ensure(max_cols + BUCKETS[-1])
        kinds = [None] if self.plan.window is None else ([FULL, SLIDING] if self.plan.hybrid else [None])
        cols = [c for c in (MIN_COLS * 2 ** i for i in range(16)) if c <= max(MIN_COLS, columns(max_cols, self.capacity))]
        for b in BUCKETS:
            x = self._inputs(b, kinds)
            x.slots.copy_(torch.arange(b, device=x.slots.device))
            for m in x.masks.values():
                m.fill_(torch.finfo(m.dtype).min)
                m[0, 0, torch.arange(b), torch.arange(b)] = 0
            for c in cols:
                if (b, c, hidden) not in self.graphs:
                    self.graphs[(b, c, hidden)] = self._capture(x, c, hidden)
        return len(self.graphs)

    # -- a feature head's taps ----------------------------------------------------------------
    def _tap_if_captured(self) -> None:
        """Under capture_aux (decoding.drafts.capture) tap every decoder layer's input, once;
        graphs captured before had no taps: they are dropped."""
        if not self.tap_hooks and getattr(self.model, "_specstop_capturing", None) is not None:
            self._install_taps()

    def _install_taps(self) -> None:
        if self.tap_hooks:
            return
        from decoding.models.target_layout import decoder_layers

        def tap(i):
            def hook(_m, args, kwargs):
                if self.tapping:  # another cache's forward of the same model (its graph pool) is not ours
                    self.taps[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        self.tap_hooks = [blk.register_forward_pre_hook(tap(i), with_kwargs=True)
                          for i, blk in enumerate(decoder_layers(self.model))]
        self.graphs = {}

    def _publish(self, taps: dict, rows: int) -> None:
        if getattr(self.model, "_specstop_capturing", None) is not None and taps:
            self.model._specstop_taps = {i: t[:, :rows] for i, t in taps.items()}

    # -- rollback ---------------------------------------------------------------------------
    @torch.inference_mode()
    def commit(self, path: Sequence[int], fed: int) -> None:
        """Keep the accepted nodes fed this round: their rows move down after the committed ones."""
        kept = [i for i in path if i < fed]
        if kept:
            s = self.length
            idx = torch.tensor(kept, device=self.model.device) + s
            # advanced indexing copies first: no aliasing
            for buf in self.stacked or [b for x in self.cache.layers if x.buf_k is not None for b in (x.buf_k, x.buf_v)]:
                buf[..., s:s + len(kept), :] = buf[..., idx, :]
        self.length = self.where.length = self.length + len(kept)
        self.nodes = 0
