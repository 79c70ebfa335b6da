"""A feature head's steps over a static KV cache in bucketed sizes, captured as CUDA graphs on the
graph forward (`set_forward(head, "graph")`; "static": the same without capture, any device).

Why: on a GPU one head step is a few dozen small kernels, launch-bound like the target's forward
(decoding.forward.static), and a round runs one step per tree level. The cache is one buffer of
`capacity` slots; a step of r rows runs in the smallest bucket >= r (padded rows write scratch
slots past the real ones and see only themselves) over the first C columns (a power of two), its
tokens, hidden inputs, positions, slots and bool mask copied into static buffers first. Steps of
more rows (a prompt's entries) run uncaptured on the same buffers. Same contract as DraftKV plus
`step`: FeatureCache (decoding.drafts.feature_proposer) calls `step` instead of the head's own.
"""

from __future__ import annotations

import torch

from decoding.forward import static
from decoding.forward.static import BUCKETS, bucket, columns


class HeadGraphs:
    """The head's KV cache (len, crop, k / v views) and its bucketed, optionally captured step."""

    def __init__(self, draft, capture: bool = False):
        if capture and draft.fc.weight.device.type != "cuda":
            raise ValueError("the graph forward needs a CUDA device")
        self.draft, self.capture = draft, capture
        self.length = self.capacity = 0
        self.buf_k = self.buf_v = None
        self.slots: torch.Tensor | None = None
        self.cols = 0
        self.inputs: dict[int, tuple] = {}
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None

    # -- DraftKV's contract ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def cut_front(self, n: int) -> None:
        """Drop the oldest n entries (a head attending a window): the rest move to the front."""
        if self.buf_k is not None and n > 0:
            keep = self.length - n
            self.buf_k[:, :, :keep] = self.buf_k[:, :, n:self.length].clone()
            self.buf_v[:, :, :keep] = self.buf_v[:, :, n:self.length].clone()
            self.length = keep

    @property
    def k(self):
        return None if self.buf_k is None else self.buf_k[:, :, :self.length]

    @property
    def v(self):
        return None if self.buf_v is None else self.buf_v[:, :, :self.length]

    def append(self, k, v):
        """Called by the head's step: write at the static slots, attend over the first `cols`."""
        if self.buf_k is None:
            self.buf_k = k.new_zeros(*k.shape[:2], self.capacity, k.shape[-1])
            self.buf_v = v.new_zeros(*v.shape[:2], self.capacity, v.shape[-1])
        self.buf_k.index_copy_(2, self.slots, k)
        self.buf_v.index_copy_(2, self.slots, v)
        return self.buf_k[:, :, :self.cols], self.buf_v[:, :, :self.cols]

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens, hidden, positions, mask=None):
        """`draft.step` with this cache: tokens [1, t], hidden [1, t, H], positions [1, t], mask
        bool [t, len + t] (None: causal). Appends t entries; returns (logits [1, t, N], h [1, t, H])."""
        t, n = tokens.shape[1], self.length
        if mask is None:
            mask = torch.cat((torch.ones(t, n, dtype=torch.bool), torch.ones(t, t, dtype=torch.bool).tril_()), 1)
        b = bucket(t)
        self._ensure(n + (b or t) + BUCKETS[-1])
        dev = self.draft.fc.weight.device
        if b is None:  # a prompt's entries: uncaptured, exact size
            self.slots, self.cols = torch.arange(n, n + t, device=dev), n + t
            out = self.draft.step(tokens, hidden, positions, self, mask.to(dev))
        else:
            out = self._bucketed(b, tokens, hidden, positions, mask)
            out = (out[0][:, :t].clone(), out[1][:, :t].clone())
        self.length = n + t
        return out

    def _ensure(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = max(static.START_CAPACITY, self.capacity)
        while cap < need:
            cap *= 2
        if self.buf_k is not None:
            k = self.buf_k.new_zeros(*self.buf_k.shape[:2], cap, self.buf_k.shape[-1])
            v = self.buf_v.new_zeros(*self.buf_v.shape[:2], cap, self.buf_v.shape[-1])
            k[:, :, :self.capacity].copy_(self.buf_k)
            v[:, :, :self.capacity].copy_(self.buf_v)
            self.buf_k, self.buf_v = k, v
        self.capacity, self.inputs, self.graphs, self.pool = cap, {}, {}, None  # a new pool: see static._ensure

    def _bucketed(self, b, tokens, hidden, positions, mask):
        t, n = tokens.shape[1], self.length
        cols = columns(n + b, self.capacity)
        x = self.inputs.get(b)
        if x is None:
            dev, dt = self.draft.fc.weight.device, self.draft.fc.weight.dtype
            x = self.inputs[b] = (torch.zeros(1, b, dtype=torch.long, device=dev),
                                  torch.zeros(1, b, self.draft.config.hidden_size, dtype=dt, device=dev),
                                  torch.zeros(1, b, dtype=torch.long, device=dev),
                                  torch.zeros(b, dtype=torch.long, device=dev),
                                  torch.zeros(b, self.capacity, dtype=torch.bool, device=dev))
        tok, hid, pos, slots, seen = x
        tok.zero_()
        tok[:, :t].copy_(tokens)
        hid.zero_()
        hid[:, :t].copy_(hidden)
        pos.copy_(positions[:, -1:].expand(1, b))
        pos[:, :t].copy_(positions)
        slots.copy_(torch.arange(n, n + b))
        m = torch.zeros(b, cols, dtype=torch.bool)
        m[:t, :mask.shape[1]] = mask
        m[torch.arange(t, b), torch.arange(n + t, n + b)] = True  # a padded row sees only itself
        seen[:, :cols].copy_(m.to(seen.device))
        if not self.capture:
            return self._run(x, cols)
        key = (b, cols)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(x, cols)
        g[0].replay()
        return g[1], g[2]

    def _run(self, x, cols):
        tok, hid, pos, slots, seen = x
        self.slots, self.cols = slots, cols
        return self.draft.step(tok, hid, pos, self, seen[:, :cols])

    def _capture(self, x, cols):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run(x, cols)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, h = self._run(x, cols)
        return graph, logits, h


def head_cache(draft):
    """The head's cache for its forward kind: HeadGraphs on static / graph, else a DraftKV."""
    from decoding.drafts.feature import DraftKV
    from decoding.forward.static import STATIC_KINDS

    kind = getattr(draft, "_specstop_forward", "eager")
    return HeadGraphs(draft, capture=kind == "graph") if kind in STATIC_KINDS else DraftKV()


def head_step(draft, cache, tokens, hidden, positions, mask=None, last: bool = False):
    """One head step on `cache`: HeadGraphs' own, else decoding.drafts.lean_step's (last: only the
    last row's logits, [B, 1, N])."""
    if isinstance(cache, HeadGraphs):
        logits, h = cache.step(tokens, hidden, positions, mask)
        return (logits[:, -1:] if last else logits), h
    from decoding.drafts import lean_step

    return lean_step.step(draft, tokens, hidden, positions, cache, mask, last)


def head_steps(draft, caches, calls):
    """[head_step(draft, cache, *call) ...] for several requests' caches: one lean step over all
    their rows where every cache is a plain DraftKV (decoding.drafts.lean_step.steps)."""
    if any(isinstance(c, HeadGraphs) for c in caches):
        return [head_step(draft, cache, *call) for cache, call in zip(caches, calls)]
    from decoding.drafts import lean_step

    return lean_step.steps(draft, caches, calls)
