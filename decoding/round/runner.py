"""The device round's state and its four steps, every one a fixed-shape tensor program over static
buffers (the host never reads anything between them):

    round():  draft levels (head step, top-k or a sample without replacement)
              -> verify (the target over the pending token and the tree, tree mask built here)
              -> accept (decoding.round.accept: the greedy walk or the multi-candidate rule)
              -> commit (the accepted rows move down both caches by index; the head's entries
                 for the committed tokens are rebuilt from the target's features; lengths += n)

State kept between rounds, all device tensors: `length` (tokens in the target's cache; the pending
token is not), `pending`, the head's anchor output (`anchor_logits`, `anchor_h`: what the entry of
the newest committed position predicts) and `out` = [n new tokens, tokens...], the one thing the
host reads. The head's cache always holds entries 0..length-1, the target's slots 0..length-1.

Invariant after `prefill(prompt)`: length = len(prompt), pending = the first new token.
"""

from __future__ import annotations

import torch

from decoding.drafts.capture import capture_aux
from decoding.forward.static import START_CAPACITY, StaticCachedModel, columns
from decoding.round import accept
from decoding.round.shape import RoundShape
from decoding.sampling import SamplingConfig, warp
from decoding.tree import TreeLayout

MARGIN = 64
"""Slots kept free past a round's last write (the tree and the head's entries)."""


class SlotKV:
    """The head's one-layer cache in a fixed buffer; a step writes at `slots` and attends over the
    first `cols` slots (the DraftKV contract FeatureDraft.step calls)."""

    def __init__(self):
        self.k = self.v = None
        self.slots, self.cols, self.capacity = None, 0, 0

    def grow(self, capacity: int) -> None:
        if self.k is not None and capacity > self.k.shape[2]:
            k = self.k.new_zeros(*self.k.shape[:2], capacity, self.k.shape[3])
            v = self.v.new_zeros(*self.v.shape[:2], capacity, self.v.shape[3])
            k[:, :, :self.k.shape[2]].copy_(self.k)
            v[:, :, :self.v.shape[2]].copy_(self.v)
            self.k, self.v = k, v
        self.capacity = max(self.capacity, capacity)

    def append(self, k, v):
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:2], self.capacity, k.shape[3])
            self.v = v.new_zeros(*v.shape[:2], self.capacity, v.shape[3])
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)
        return self.k[:, :, :self.cols], self.v[:, :, :self.cols]

    def at(self, slots, cols):
        self.slots, self.cols = slots, cols
        return self


class DeviceRound:
    def __init__(self, target, head, shape: RoundShape, sampling: SamplingConfig):
        self.sc = StaticCachedModel(target, capture=False)
        if self.sc.plan.window is not None:
            raise ValueError("the device round supports full-attention targets only (this one has sliding "
                             "windows): use --round host")
        if shape.depth and head is None:
            raise ValueError("the device round drafts with a feature head (--draft a head directory)")
        self.target, self.head, self.shape, self.sampling = target, head, shape, sampling
        self.dev = next(target.parameters()).device
        self.st = shape.tensors(self.dev)
        self.ks, self.depth, self.rows, self.levels = shape.ks, shape.depth, shape.rows, shape.levels
        """Plain copies of the shape's (cached) properties: what the traced round reads."""
        self.kv = SlotKV()
        self.aux = tuple(head.config.aux_layers) if head is not None else ()
        self.used = head.used_ids.to(self.dev) if head is not None else None
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=self.dev)  # noqa: E731
        self.length, self.pending = z(()), z(())
        self.out = z(shape.depth + 2)
        if head is not None:
            wdt = head.fc.weight.dtype
            self.anchor_logits = z(head.config.draft_vocab_size, dt=wdt)
            self.anchor_h = z(head.config.hidden_size, dt=wdt)
        self.sc._install_taps()
        self.epoch = 0
        """Bumped whenever the buffers move: graphs captured before read the old ones."""

    # -- the host's side: sizes -------------------------------------------------------------
    def span(self) -> int:
        """Slots a round writes past `length`: its rows, the head's nodes and entries."""
        return max(self.shape.rows, self.shape.depth + 1)

    def cols_for(self, length: int) -> int:
        """The cache columns a round after `length` committed slots attends over (a graph key)."""
        return columns(length + self.span(), self.sc.capacity)

    def ensure(self, length: int) -> bool:
        """Room for a round after `length` slots; True when the buffers moved (graphs are stale)."""
        need = length + self.span() + MARGIN
        if need <= self.sc.capacity and need <= self.kv.capacity:
            return False
        cap = max(START_CAPACITY, self.sc.capacity)
        while cap < need:
            cap *= 2
        self.sc._ensure(cap)
        self.kv.grow(cap)
        self.epoch += 1
        return True

    # -- a sequence's start (eager: once a request) ---------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> int:
        """The prompt through the target (and the head's entries for it); returns the first token."""
        self.sc.reset()
        n = len(prompt)
        self.ensure(n)
        with capture_aux(self.target, self.aux or (0,)) as cap:
            logits = self.sc.feed(prompt, TreeLayout(()), [], 0, 0)[0]
        first = self._first_token(logits[-1])
        self.length.fill_(n)
        self.pending.fill_(first)
        if self.head is not None:
            feats = cap.aux()[0][:n].to(self.dev)
            toks = torch.tensor([prompt[1:] + [first]], device=self.dev)
            mask = torch.ones(n, n, dtype=torch.bool, device=self.dev).tril_()
            lg, h = self.head.step(toks, self.head.fuse(feats)[None], torch.arange(n, device=self.dev)[None],
                                   self.kv.at(torch.arange(n, device=self.dev), n), mask)
            self.anchor_logits.copy_(lg[0, -1])
            self.anchor_h.copy_(h[0, -1])
        return first

    def _first_token(self, logits) -> int:
        if self.sampling.greedy:
            return int(logits.argmax())
        p = warp(logits, self.sampling)
        return int(accept.exponential_race(p, torch.empty_like(p).exponential_()))

    # -- the round ------------------------------------------------------------------------------
    @torch.inference_mode()
    def round(self, cols: int) -> torch.Tensor:
        """One whole round over the first `cols` cache columns; returns `out`."""
        nodes, valid, q_rows = self.draft(cols)
        ids = torch.cat((self.pending[None], nodes))
        logits, feats = self.verify(ids, cols)
        if self.sampling.greedy:
            n, path, bonus = accept.greedy_walk(ids, logits.argmax(-1), self.st, self.depth)
        else:
            u = torch.rand(max(self.depth, 1), max(self.ks or (1,)), device=self.dev)
            e = torch.empty(logits.shape[-1], device=self.dev).exponential_()
            p_rows = warp(logits, self.sampling)
            valid_rows = torch.cat((valid.new_ones(1), valid))
            n, path, bonus = accept.sampling_walk(p_rows, q_rows, ids, valid_rows, self.st, self.ks, u, e)
        self.commit(ids, n, path, bonus, feats, cols)
        return self.out

    def draft(self, cols: int):
        """The tree's tokens [N] (target ids), their validity and the q rows [R, V] each row's
        children were drawn from (sampling only)."""
        dev = self.dev
        if not self.depth:
            return torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, dtype=torch.bool, device=dev), None
        logits, parent_h = self.anchor_logits[None], self.anchor_h[None]
        toks, valid, qs = [], [], []
        for d, k in enumerate(self.ks):
            if self.sampling.greedy:  # any children keep greedy lossless: the top k, all valid
                x = logits.float().topk(k, dim=-1).indices
                valid.append(torch.ones(x.numel(), dtype=torch.bool, device=dev))
            else:  # the first k of a draw without replacement from q, in draw order
                q = warp(logits, self.sampling)  # [n_parents, N]
                qs.append(q)
                x = (q / torch.empty_like(q).exponential_()).topk(k, dim=-1).indices
                valid.append(q.gather(1, x).reshape(-1) > 0)
            toks.append(self.used[x.reshape(-1)])
            if d + 1 < self.depth:  # this level's nodes get children: one head step over them
                start, end = self.levels[d]
                hid = parent_h.repeat_interleave(k, 0)
                pos = (self.length + d).expand(end - start)
                slots = self.length + torch.arange(start - 1, end - 1, device=dev)
                lg, h = self.head.step(toks[-1][None], hid[None], pos[None], self.kv.at(slots, cols),
                                       self._node_mask(start, end, cols))
                logits, parent_h = lg[0], h[0]
        q_rows = None
        if not self.sampling.greedy:  # over the target's vocabulary: exactly 0 off the head's
            q = torch.cat(qs)
            full = q.new_zeros(self.rows, self.head.config.vocab_size)
            q_rows = full.index_copy(1, self.used, torch.cat((q, q.new_zeros(self.rows - q.shape[0], q.shape[1]))))
        return torch.cat(toks), torch.cat(valid), q_rows

    def _node_mask(self, start: int, end: int, cols: int) -> torch.Tensor:
        """Bool [end - start, cols]: the committed entries and each node's own ancestors (whose
        entries sit at slot length + row - 1)."""
        c = torch.arange(cols, device=self.dev)
        rel = c - self.length  # node index of a tree entry's slot
        nodes = self.st.ancestors[start:end, 1:]  # [n, N]
        inside = (rel >= 0) & (rel < nodes.shape[1])
        return (c < self.length)[None] | (inside[None] & nodes[:, rel.clamp(0, nodes.shape[1] - 1)])

    def verify(self, ids, cols: int):
        """The target over the rows: logits [R, V] (float32) and the head's features [R, 3H]."""
        dev, L = self.dev, self.length
        c = torch.arange(cols, device=dev)
        rel = c - L
        inside = (rel >= 0) & (rel < self.rows)
        seen = (c < L)[None] | (inside[None] & self.st.ancestors[:, rel.clamp(0, self.rows - 1)])
        dt = self.target.dtype
        mask = torch.zeros(seen.shape, dtype=dt, device=dev).masked_fill_(~seen, torch.finfo(dt).min)
        slots = L + torch.arange(self.rows, device=dev)
        logits, _ = self.sc._run(ids[None], (L + self.st.depths)[None], slots, cols, {None: mask[None, None]}, False)
        feats = torch.cat([self.sc.taps[i][0] for i in self.aux], -1) if self.aux else None
        return logits.float(), feats

    def commit(self, ids, n, path, bonus, feats, cols: int) -> None:
        dev, L = self.dev, self.length
        D = self.depth
        ar = torch.arange(D + 1, device=dev)
        along = torch.cat((ids[path], bonus[None])) if D else bonus[None]
        new = torch.where(ar < n, along, torch.where(ar == n, bonus, 0))  # x_{L+1} .. x_{L+n+1}
        if D:  # the accepted rows move down after the pending token's slot
            src, dst = L + path, L + 1 + torch.arange(D, device=dev)
            for buf in self._buffers():
                buf.index_copy_(-2, dst, buf.index_select(-2, src))
        if self.head is not None:  # the head's entries of positions L .. L+n, from true features
            f = self.head.fuse(feats[torch.cat((path.new_zeros(1), path))])
            c = torch.arange(cols, device=dev)
            seen = (c[None] < L) | ((c[None] - L >= 0) & (c[None] - L <= ar[:, None]))
            slots = L + ar
            lg, h = self.head.step(new[None], f[None], slots[None], self.kv.at(slots, cols), seen)
            self.anchor_logits.copy_(lg[0].index_select(0, n[None])[0])
            self.anchor_h.copy_(h[0].index_select(0, n[None])[0])
        self.out.copy_(torch.cat(((n + 1)[None], new)))
        self.length.add_(n + 1)
        self.pending.copy_(bonus)

    def _buffers(self):
        if self.sc.stacked is not None:
            return self.sc.stacked
        return [b for x in self.sc.cache.layers if x.buf_k is not None for b in (x.buf_k, x.buf_v)]
