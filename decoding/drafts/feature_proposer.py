"""Drafting with an EAGLE-3 feature head, for every strategy and stop policy.

The head reads the target's hidden states, so the engine runs each verify forward inside
`FeatureProposer.verifying()`: pre-hooks capture the three layers' inputs for the pending
committed tokens and for every tree node. At the next proposal the rows of the committed
tokens (pending + accepted path) enter the head's cache as entries built from those TRUE
features; the entries the head wrote for this round's tree (built from its own h) are all
dropped at commit, never kept (keeping them costs acceptance: vLLM #14649).

Draft entry at position p = (target features at p, token p + 1), predicting token p + 2. The
anchor (last committed token) is the token of the newest entry, whose output gives the first
level; a depth-d node sits at position anchor + d - 1 and reads its parent's h. When the
anchor's own features are known (longest-branch rounds, where every committed token was
verified) the first level reads them instead. The first round has no features yet: it
drafts nothing, and the target's prompt forward provides them.

Draft ids map to target ids through `d2t`; q over the target vocabulary is the draft's
distribution scattered there (exactly 0 elsewhere), so the acceptance rules stay exact. The
proposer warps and draws over the head's own vocabulary and scatters q after
(TreeProposer.vocab_ids); a FeatureCache read on its own gives target-vocabulary logits.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from decoding.drafts.capture import capture_aux, decoder_layers
from decoding.drafts.feature import FeatureDraft
from decoding.drafts.head_graph import head_cache, head_step
from decoding.models import MASKED_LOGIT
from decoding.options import HEAD_WINDOW
from decoding.tree_proposer import DraftTree, TreeProposer, empty_tree
from decoding.sampling import SamplingConfig
from decoding.tree import ANCHOR, TreeLayout

FEATURE_LEAD = 64
"""Plain rounds before a possible draft from which a feature head takes in the target's features
again: enough entries to draft near its acceptance with a full window (64 entries where it
attends up to HEAD_WINDOW), so a look after many skipped rounds measures drafting about as it
would run, and catches up on 64 rows at most."""


class FeatureCache:
    """The head, its KV cache and the target features it has not consumed yet."""

    def __init__(self, draft: FeatureDraft, window: int | None = None):
        self.draft = draft
        self.window = window
        """Committed positions the head attends back (None: all): older entries are skipped at a
        catch-up and cut from the front as the cache grows; positions stay absolute, so the
        rotary distances to the entries kept are the true ones."""
        self.own_vocab = False
        """feed / plan give logits over the head's own vocabulary (the proposer's reading), not
        scattered to the target's."""
        self.catch_up: int | None = FEATURE_LEAD
        """Most rows an empty cache (a new prompt, a gap) is built from (None: the window's): a new
        prompt starts as a look after a gap does, its catch-up ~2 ms rather than 7.5-16 for 256
        rows (Zen 5, 2 threads), which each request's first look pays (the request gate,
        decoding.stopping.prompt_gate); the cache then grows to the window."""
        self.reset()

    def reset(self) -> None:
        self.cache = head_cache(self.draft)  # a DraftKV, or static buffers (head_graph)
        self.length = 0  # committed positions the cache has reached (entries up to position length-1)
        self.entries = 0  # committed entries it holds: fewer than length where a window skipped or cut the oldest
        self.known = 0  # committed positions whose target features are known
        self._chunks: list[torch.Tensor] = []  # rows, as appended (the `rows` property)
        self.captured: torch.Tensor | None = None  # rows of the latest verify forward
        self.path: list[int] = []
        self.tree_size = 0  # nodes of the tree that verify forward checked
        self.anchor_out = None  # (logits, h, normed h) of the newest committed entry
        self.node_h: dict[int, torch.Tensor] = {}
        self.behind_ms = 0.0  # this round's catch-up beyond one entry (TreeProposer.behind_ms)

    def ingest(self) -> None:
        """Append the features of the tokens the last round committed (pending + accepted path);
        a new round begins (its catch-up not timed yet)."""
        self.behind_ms = 0.0
        if self.captured is None:
            return
        rows, n_pend = self.captured, self.captured.shape[0] - self.tree_size
        new = rows[:n_pend] if not self.path else torch.cat((rows[:n_pend], rows[n_pend + torch.tensor(self.path)]))
        self._chunks.append(new)
        self.known += new.shape[0]
        self.captured, self.path = None, []

    @property
    def rows(self) -> torch.Tensor | None:
        """Features of positions length .. known-1, joined when read (the catch-up, the anchor).
        Why not a cat per round: rounds that do not draft (decoding.batch.measured) leave rows
        unconsumed, the prompt's among them, and a cat a round copied them all (~10% of a plain
        round at 8 requests); a buffer grown by doubling fragmented the heap instead."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0] if self._chunks else None

    @rows.setter
    def rows(self, value: torch.Tensor | None) -> None:
        self._chunks = [] if value is None else [value]

    def ready(self, n: int) -> bool:
        """Can draft below committed token n-1: entries up to position n-2 can be built (and,
        after a gap, at least one has been)."""
        return n >= 2 and self.known >= n - 1 and (self.anchor_out is not None or self.known > self.length)

    def gap(self, n: int) -> None:
        """The round verifying committed token n-1 captures no features: the head starts over
        from the next captured position (its entries before the gap are dropped, positions stay
        absolute; as a window's cut, attending back past a gap is not what it was trained on)."""
        self.captured, self.path = None, []
        self.cache.crop(0)
        self.known = self.length = n
        self.entries, self.rows, self.anchor_out, self.node_h = 0, None, None, {}

    @torch.inference_mode()
    def feed(self, committed, layout: TreeLayout, node_tokens, start: int, end: int, hidden: bool = False):
        """Same contract as CachedModel.feed: logits over the TARGET vocabulary for the anchor
        (when start == end) or for nodes start..end-1, plus normed hidden states if asked."""
        if start == 0:
            self._catch_up(committed)
            self.node_h = {}
        if start == end:
            return self._anchor(hidden)
        logits, h = head_step(self.draft, self.cache, *self._node_args(committed, layout, node_tokens, start, end))
        return self._nodes_fed(start, end, logits, h, hidden)

    def plan(self, committed, layout: TreeLayout, node_tokens, start: int, end: int):
        """feed(...) cut at its one head step, for a level drafted beside other requests'
        (decoding.batch.drafting): (the step's arguments after the cache, or None when it takes
        none; finish(logits, h, hidden) -> what feed returns). For the two feeds a drafted level
        makes: the anchor's (start == end == 0: the committed entries caught up) and a level's
        nodes (after the anchor's: for the first level's, start == 0, nothing is left to catch up)."""
        if start == 0 and end == 0:
            self.node_h = {}
            args = self._catch_up_args(committed)

            def anchor(logits, h, hidden):
                if args is not None:
                    self._caught_up(len(committed), logits, h)
                return self._anchor(hidden)
            return args, anchor
        if start == 0:  # as feed: the catch-up first (a step of its own only if the anchor's left one)
            self._catch_up(committed)
            self.node_h = {}
        return (self._node_args(committed, layout, node_tokens, start, end),
                lambda logits, h, hidden: self._nodes_fed(start, end, logits, h, hidden))

    def _anchor(self, hidden: bool):
        logits, _, hn = self.anchor_out
        return self._out(logits[None], hn[None] if hidden else None)

    def _node_args(self, committed, layout: TreeLayout, node_tokens, start: int, end: int):
        """(tokens, hidden, positions, mask) of nodes start..end-1, each reading its parent's h."""
        dev, n = self.draft.fc.weight.device, len(committed)
        parents = [layout.parents[i] for i in range(start, end)]
        anchor_h = self._anchor_hidden(n)
        hid = torch.stack([anchor_h if p == ANCHOR else self.node_h[p] for p in parents])[None]
        pos = (n - 2 + layout.depth_ids[start:end]).to(dev)[None]
        mask = torch.cat((torch.ones(end - start, self.entries, dtype=torch.bool), layout.mask[start:end, :end]), 1)
        return torch.tensor([list(node_tokens)], device=dev), hid, pos, mask

    def _nodes_fed(self, start: int, end: int, logits, h, hidden: bool):
        for i, node in enumerate(range(start, end)):
            self.node_h[node] = h[0, i]
        return self._out(logits[0], self.draft.norm(h[0]) if hidden else None)

    def _out(self, logits, hn):
        return (logits.float() if self.own_vocab else self.draft.to_target(logits.float(), MASKED_LOGIT)), hn

    def _catch_up(self, committed) -> None:
        """Build the committed entries whose features and next token are both known."""
        args = self._catch_up_args(committed)
        if args is not None:
            t, k = time.perf_counter(), args[0].shape[1]
            self._caught_up(len(committed), *head_step(self.draft, self.cache, *args))
            self.behind_ms += 1000 * (time.perf_counter() - t) * (k - 1) / k

    def _catch_up_args(self, committed):
        """The catch-up step's (tokens, hidden, positions, mask, last), or None when nothing is
        new; last: only the newest entry's logits are read (the anchor's)."""
        self.cache.crop(self.entries)  # a cut-short round may have left tree entries behind
        e = min(self.known, len(committed) - 1)
        if e <= self.length:
            return None
        span = self.window
        if self.catch_up and not self.entries:
            span = min(span or self.catch_up, self.catch_up)
        skip = e - self.length - span if span else 0
        if skip > 0:  # only the newest `window` positions are built (positions stay absolute)
            self.rows, self.length = self.rows[skip:], self.length + skip
        d, dev = self.draft, self.draft.fc.weight.device
        k = e - self.length
        toks = torch.tensor([committed[self.length + 1: e + 1]], device=dev)
        pos = torch.arange(self.length, e, device=dev)[None]
        return toks, d.fuse(self.rows[:k].to(dev))[None], pos, None, True

    def _caught_up(self, n: int, logits, h) -> None:
        k = h.shape[1]
        self.rows = self.rows[k:]
        self.length += k
        self.entries += k
        if self.window and self.entries > self.window + self.window // 2:  # cut in steps: each cut copies
            self.cache.cut_front(self.entries - self.window)
            self.entries = self.window
        if self.length == n - 1:
            self.anchor_out = (logits[0, -1], h[0, -1], self.draft.norm(h[0, -1]))

    def _anchor_hidden(self, n: int) -> torch.Tensor:
        if self.known >= n:  # the anchor itself was verified: its true features
            return self.draft.fuse(self.rows[0].to(self.draft.fc.weight.device))
        return self.anchor_out[1]

    def commit(self, path, fed: int) -> None:
        """Drop every tree entry; the accepted ones come back from the target's features."""
        self.cache.crop(self.entries)
        self.path = list(path)


class FeatureProposer(TreeProposer):
    """TreeProposer whose draft is a FeatureDraft reading `target`'s hidden states."""

    cache_for = staticmethod(lambda draft: FeatureCache(draft))

    def __init__(self, draft: FeatureDraft, target, layout: TreeLayout, sampling: SamplingConfig,
                 replacement: bool = False, roots_from_target: bool = False, window: int = HEAD_WINDOW):
        super().__init__(draft, layout, sampling, replacement, roots_from_target)
        self.model.window = window or None  # 0: the whole context
        self.model.own_vocab = True
        self.set_vocab(draft.used_ids, draft.config.vocab_size)
        self.target = target
        self.capturing = True
        """Does this round's verify capture the target's features (`plain` may say no)?"""
        n_layers = len(decoder_layers(target))
        if n_layers != draft.config.target_num_layers:
            raise ValueError(f"feature draft expects a {draft.config.target_num_layers}-layer target, "
                             f"this one has {n_layers}")

    @property
    def behind_ms(self) -> float:
        return self.model.behind_ms

    @contextmanager
    def verifying(self):
        """Wrap the engine's verify forward: capture the target's states for the next round
        (unless `plain` said they will not be read)."""
        if not self.capturing:
            yield
            return
        with capture_aux(self.target, self.model.draft.config.aux_layers) as cap:
            yield
        self.model.captured = cap.aux()[0]

    def plain(self, ahead: int = 0, committed: int | None = None) -> None:
        """No tree this round: still take in the target's features of what was committed, so
        the head can draft again next round. `ahead`: plain rounds sure to follow this one; past
        FEATURE_LEAD of them, with `committed` (the committed length), this round's features are
        not captured at all (a gap: a round that captures ran 1.017x [0.996, 1.039] one that does not,
        1,200 cached tokens, AVX2 Zen 3, 2 threads; and the head catches up on fewer rows)."""
        self.capturing = ahead < FEATURE_LEAD or committed is None
        if self.capturing:
            self.model.ingest()
        else:
            self.model.gap(committed)
        self.model.tree_size = 0

    def propose(self, committed, stop, generator, anchor_p=None, position: int = 0,
                hidden: bool = False) -> DraftTree:
        self.capturing = True
        self.model.ingest()
        if not self.model.ready(len(committed)):
            tree = empty_tree()
        else:
            tree = super().propose(committed, stop, generator, anchor_p, position, hidden)
        self.model.tree_size = tree.size
        return tree
