"""Continuous batching of speculative rounds: N requests, one target forward a round.

Why: decoding/engine.py runs one request's round (propose -> verify -> decide -> commit); a
server holds many. `BatchEngine` keeps each request's own state (its target KV cache, its
proposer with its draft cache, its stop policy, sampling config and generator) and runs rounds in
which every active request drafts its tree (the draft runs per request), all trees are verified
in ONE target forward (decoding.batch.forward), and each request decides and commits with the
engine's acceptance rules. Requests join (`add`) and leave (`remove`, or when done) between
rounds; leaving drops that request's caches and touches no other request's.

Trees are sized either per request (each request's own StopPolicy, the batch-1 proposer as is) or
by one budget across requests (`budget`: decoding.batch.budget.JointGrow). `swap` replaces the
draft and stop policy / budget for requests that join later; each request keeps the ones it was
admitted with (decoding.batch.binding).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding import acceptance as acc
from decoding.batch.binding import Models, check_swap
from decoding.batch.budget import JointGrow
from decoding.batch.drafting import Drafting, draft_jointly
from decoding.batch.forward import Segment, verify_many
from decoding.batch.logprobs import MAX_TOP, TokenLogprob, token_logprobs
from decoding.batch.measured import MeasuredChoice
from decoding.batch.prefill import ChunkSizer
from decoding.drafts.feature import FeatureDraft
from decoding.drafts.feature_proposer import FeatureProposer
from decoding.engine import Outcome
from decoding.forward.packed import forward_kind
from decoding.kv_cache import CachedModel
from decoding.options import HEAD_WINDOW
from decoding.tree_proposer import DraftTree, TreeProposer, empty_tree
from decoding.run_stats import RunStats
from decoding.sampling import SamplingConfig, argmax_rows, warp
from decoding.stopping import FixedDepth, StopPolicy
from decoding.tree import TreeLayout


@dataclass
class Request:
    """One request: what was asked, and its own decoding state."""

    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    eos: frozenset = frozenset()
    on_tokens: Callable[[list[int]], None] | None = None
    id: int = 0
    out: list[int] = field(default_factory=list)
    done: bool = False
    stats: RunStats | None = None
    cache: CachedModel | None = field(default=None, repr=False)
    proposer: TreeProposer | None = field(default=None, repr=False)
    stop: StopPolicy | None = field(default=None, repr=False)
    gen: torch.Generator | None = field(default=None, repr=False)
    joined_round: int = 0
    error: BaseException | None = None
    """What `on_tokens` raised (a client gone): the request left there, the others ran on."""
    top_logprobs: int | None = None
    """None: no logprobs (none computed); k: each output token's logprob and k alternatives."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per token of `out`, where `top_logprobs` is set (decoding.batch.logprobs)."""
    models: Models | None = field(default=None, repr=False)
    """The draft and stop policy / budget it was admitted with (dropped when it leaves)."""
    version: int = 0
    """Its models' version (Models.version), kept after it leaves."""

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.out


def decide(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, replacement: bool,
           gen) -> tuple[list[int], list[int]]:
    """(accepted path, committed tokens) of one verified tree, as SpeculativeEngine._decide in its
    lossless mode: logits[-size-1] is the anchor's row, node i's is logits[-size + i]."""
    n = tree.size
    if sampling.greedy:
        w = acc.walk_greedy(tree.layout.children, tree.tokens, argmax_rows(logits[-n - 1:]))
    else:
        row = lambda i: logits[len(logits) - n + i] if i >= 0 else logits[len(logits) - n - 1]  # noqa: E731
        w = acc.walk_sampling(tree.layout.children, tree.tokens, tree.valid, lambda i: warp(row(i), sampling),
                              tree.q.__getitem__, replacement, gen)
    return w.path, [tree.tokens[i] for i in w.path] + [w.next_token]


class BatchEngine:
    """Rounds of speculative decoding for several requests at once (see the module docstring).

    target / draft: loaded models (draft None: plain decoding, one row per request); layout: the
    largest tree a request may draft (its depth caps the joint budget's trees too); stop: a
    factory of each request's own stop policy (independent trees); budget: one JointGrow for the
    whole round instead."""

    def __init__(self, target, draft=None, layout: TreeLayout | None = None,
                 stop: Callable[[], StopPolicy] | None = None, budget: JointGrow | None = None,
                 replacement: bool = False, name: str = "batch", measured: MeasuredChoice | None = None,
                 chunk: int | ChunkSizer | None = None, head_window: int = HEAD_WINDOW):
        if draft is not None and layout is None:
            raise ValueError("a draft needs a tree layout (the largest tree a request drafts)")
        kind = forward_kind(target)
        if kind not in ("eager", "packed", "lean"):
            raise ValueError(f"batched rounds run the eager, packed or lean forward (the target runs {kind})")
        self.target, self.layout = target, layout
        self.models = Models(draft, stop or FixedDepth, budget)
        """What requests joining now are bound to (`swap` replaces it)."""
        self.measured = measured if budget is not None else None
        """Whether a round drafts at all, by its own timings (decoding.batch.measured; the joint
        budget only)."""
        _share_steps(self.models)
        self.replacement = replacement
        self.name = name
        self.active: list[Request] = []
        self.rounds = 0
        self.verify_rows: collections.deque[int] = collections.deque(maxlen=1 << 16)
        """Rows of each recent round's verify forward (all requests together; bounded: a server
        runs rounds for ever)."""
        self._ids = itertools.count()
        self.head_window = head_window
        """Committed positions a feature head attends back (0: all; StrategyOptions.head_window)."""
        self.chunk = chunk
        """Prompt tokens a request feeds a round at most (None: a whole prompt in one round), or a
        ChunkSizer deciding that each round by measured time: a long prompt then goes in over
        several rounds beside the running requests' trees, which would otherwise all wait for its
        one forward."""
        self._chunks: list[Segment] = []
        self.failed: list[Request] = []
        """Requests whose own part of a round raised (their `error`): they left; the caller reads and
        clears this after each step."""
        self.observer: Callable | None = None
        """Optional callable(request, tree, logits, outcome, position) after each request's verified
        round with a tree: trace collection (training.decider.collect), as SpeculativeEngine.observer
        with the request first."""

    @property
    def draft(self):
        return self.models.draft

    @property
    def stop_factory(self) -> Callable[[], StopPolicy]:
        return self.models.stop

    @property
    def budget(self) -> JointGrow | None:
        return self.models.budget

    def swap(self, draft, stop: Callable[[], StopPolicy] | None = None, budget: JointGrow | None = None) -> Models:
        """Requests joining from now on draft with `draft` and stop by `stop` (or the joint
        `budget`); those running keep theirs until they leave. The run's kind stays (a draft for a
        draft, a budget for a budget: ValueError otherwise). Returns the new binding."""
        new = Models(draft, stop or FixedDepth, budget, self.models.version + 1)
        check_swap(self.models, new)
        _share_steps(new)
        self.models = new
        return new

    def add(self, prompt, max_new_tokens: int = 128, sampling: SamplingConfig | None = None, seed: int = 0,
            eos_token_id=None, on_tokens=None, top_logprobs: int | None = None) -> Request:
        """A request joining at the next round; `top_logprobs`: see Request."""
        if not prompt:
            raise ValueError("empty prompt")
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP}] (got {top_logprobs})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        req = Request(list(prompt), max_new_tokens, sampling or SamplingConfig(), seed, eos, on_tokens,
                      next(self._ids), joined_round=self.rounds, top_logprobs=top_logprobs,
                      models=self.models, version=self.models.version)
        req.cache = CachedModel(self.target)
        req.cache.reserve(reserve_for(self.target, len(req.prompt), max_new_tokens))
        req.gen = torch.Generator(device=self.target.device).manual_seed(seed)
        req.stats = RunStats(self.name, True)
        self._bind(req)
        self.active.append(req)
        return req

    def _bind(self, r: Request) -> None:
        """A fresh proposer and stop policy from the request's own models."""
        draft = r.models.draft
        if draft is None:
            return
        if isinstance(draft, FeatureDraft):
            r.proposer = FeatureProposer(draft, self.target, self.layout, r.sampling, self.replacement,
                                         window=self.head_window)
        else:
            r.proposer = TreeProposer(draft, self.layout, r.sampling, self.replacement)
        r.stop = r.models.stop()

    def remove(self, req: Request) -> None:
        """The request leaves: its caches go (no other request's cache is touched)."""
        if req in self.active:
            self.active.remove(req)
        req.cache = req.proposer = req.stop = req.models = None  # the last request of a swapped-out draft frees it

    def step(self) -> list[Request]:
        """One round for every active request; returns those that finished (and left). A request
        whose part of the round fails leaves alone (`failed`); the others go on."""
        reqs = list(self.active)
        if not reqs:
            return []
        try:
            return self._step(reqs)
        except Exception:
            return self._isolate(reqs)

    def _isolate(self, reqs: list[Request]) -> list[Request]:
        """A round raised, and any request may be half-way through it: every one is rebuilt from
        its committed text (new caches; its generator, output and stats kept) and runs one round
        alone. One that fails again leaves with its error in `failed`; the others continue (a greedy
        request's text is unchanged: its next round reads the same committed text). A rebuilt request
        longer than a chunk fills alone first: were its round left to the next shared one, a fault of
        its own would trip that round again, and every request would be rebuilt for ever."""
        finished = [r for r in reqs if r.done]  # ended in the round that raised, before the fault
        for r in finished:
            r.stats.context = len(r.committed)
            self.remove(r)
        reqs = [r for r in reqs if not r.done]
        for r in reqs:
            self._rebuild(r)
        for r in reqs:
            try:
                while (n := self._limit(0)) and len(r.committed) - r.cache.length > n:
                    self._step([r])  # one chunk in, deciding nothing
                finished += self._step([r])
            except Exception as e:
                r.error, r.done = _bare(e), True
                self.failed.append(r)
                self.remove(r)
        return finished

    def _rebuild(self, r: Request) -> None:
        r.cache = CachedModel(self.target)
        r.cache.reserve(reserve_for(self.target, len(r.prompt), r.max_new_tokens))
        self._bind(r)  # its own models, not the engine's current ones

    def _limit(self, running: int) -> int | None:
        """Prompt rows a request feeds this round beside `running` decoding requests (None: whole
        prompts; 0: the filling requests sit this round out)."""
        return self.chunk.size(running) if isinstance(self.chunk, ChunkSizer) else self.chunk or None

    def _step(self, reqs: list[Request]) -> list[Request]:
        start = time.perf_counter()
        running = sum(len(r.committed) - r.cache.length == 1 for r in reqs)  # decoding, no prompt left
        n = self._limit(running) if running < len(reqs) else None
        if n is not None:  # a long prompt goes in chunks beside the others' rounds, deciding nothing yet
            whole = self.chunk.whole if isinstance(self.chunk, ChunkSizer) else 0
            filling = [r for r in reqs if len(r.committed) - r.cache.length > max(n, 1) and len(r.prompt) > whole]
            if filling:
                reqs = [r for r in reqs if r not in filling]
                if n:
                    self._fill(filling, reqs, n)
                if not reqs:
                    self.rounds += 1
                    return []
        t0 = time.perf_counter()
        prefill = sum(s.rows for s in self._chunks) + sum(len(r.committed) - r.cache.length - 1 for r in reqs)
        steady = not prefill  # no prompt rows: a decoding round's time (prompt rows would inflate its mode's)
        # one request: the budget's priced gate decides, as the batch-1 engine's policy does (the
        # measured choice, timing rounds, erred to plain rounds there: reports/serve-2026-11-28/
        # joint-decider, "One request"); more: the measured choice, where there is one
        gated = self.budget is not None and len(reqs) == 1
        drafts = self.budget.drafts(len(reqs[0].committed), steady) if gated else \
            self.measured is None or self.measured.drafts(len(reqs), steady)
        accepted = reqs[0].stats.accepted
        trees = self._propose(reqs) if drafts else \
            self._plain(reqs, (self.budget if gated else self.measured).lookahead())
        t1 = time.perf_counter()
        segs = [Segment(r.cache, r.committed, t.layout, t.tokens, self._capture(r)) for r, t in zip(reqs, trees)]
        chunks, self._chunks = self._chunks, []
        self.verify_rows.append(sum(s.rows for s in segs + chunks))
        logits = verify_many(self.target, segs + chunks)[:len(segs)]
        _chunks_fed(chunks)
        t2 = time.perf_counter()
        finished, before = [], sum(len(r.out) for r in reqs)
        for r, t, s, lg in zip(reqs, trees, segs, logits):
            if self._commit(r, t, s, lg, t1 - t0, t2 - t1):
                finished.append(r)
        t3 = time.perf_counter()
        if gated:
            self.budget.record(reqs[0].stats.accepted - accepted)
            if steady:
                behind = reqs[0].proposer.behind_ms if drafts and reqs[0].proposer is not None else 0.0
                self.budget.timed(drafts, 1000 * (t3 - t0), behind)
        if self.measured is not None and steady:
            self.measured.record(len(reqs), drafts, sum(len(r.out) for r in reqs) - before, 1000 * (t3 - t0))
        if isinstance(self.chunk, ChunkSizer):
            self.chunk.record(1000 * (t3 - start), prefill, running)
        for r in reqs:  # the shared times, split evenly, so per-request stats add up to the wall
            r.stats.wall_s += (t3 - t0) / len(reqs)
        for r in finished:
            r.stats.context = len(r.committed)
            self.remove(r)
        self.rounds += 1
        return finished

    def run(self) -> None:
        """Rounds until no request is active."""
        while self.active:
            self.step()

    def _capture(self, r: Request) -> tuple[int, ...]:
        return tuple(r.proposer.model.draft.config.aux_layers) \
            if isinstance(r.proposer, FeatureProposer) and r.proposer.capturing else ()

    def _propose(self, reqs: list[Request]) -> list[DraftTree]:
        if self.draft is None:
            return [empty_tree() for _ in reqs]
        if self.budget is None:  # each request's own policy, which may skip its draft (a plain row)
            return [r.proposer.propose(r.committed, r.stop, r.gen, None, len(r.out), r.stop.needs_hidden)
                    if r.stop.drafts(len(r.committed)) else self._plain([r])[0] for r in reqs]
        ds = [Drafting(r.proposer, r.committed, r.gen, len(r.out), r.models.budget.needs_hidden) for r in reqs]
        self.budget.begin([len(r.committed) - r.cache.length for r in reqs], [not d.done for d in ds],
                          [r.cache.length for r in reqs], [r.models.budget for r in reqs])
        return draft_jointly(ds, self.budget)

    def _fill(self, filling: list[Request], others: list[Request], n: int) -> None:
        """The next `n` prompt tokens of each filling request, as segments of no tree that ride
        in this round's verify (or alone, when no other request runs)."""
        for r in filling:
            if r.proposer is not None:
                r.proposer.plain()  # takes in the previous chunk's features
            seg = Segment(r.cache, r.committed[:r.cache.length + n], TreeLayout(()), [], self._capture(r))
            seg.proposer = r.proposer
            self._chunks.append(seg)
        if not others:
            chunks, self._chunks = self._chunks, []
            self.verify_rows.append(sum(s.rows for s in chunks))
            verify_many(self.target, chunks)
            _chunks_fed(chunks)

    def _plain(self, reqs: list[Request], ahead: int = 0) -> list[DraftTree]:
        """No tree this round (one row a request); a feature head still takes in the target's
        features of what was committed, so it can draft again next round, unless `ahead` plain
        rounds will follow first (FeatureProposer.plain)."""
        for r in reqs:
            if r.proposer is not None:
                r.proposer.plain(ahead, len(r.committed))
        return [empty_tree() for _ in reqs]

    def _commit(self, r: Request, tree: DraftTree, seg: Segment, logits, draft_s: float, verify_s: float) -> bool:
        """Decide and commit one request's round; True when it is done."""
        t = time.perf_counter()
        path, toks = decide(tree, logits, r.sampling, self.replacement, r.gen)
        if self.observer is not None and tree.size:
            self.observer(r, tree, logits, Outcome(path, toks), len(r.out))
        r.cache.commit(path, tree.size)
        if r.proposer is not None:
            if isinstance(r.proposer, FeatureProposer):
                r.proposer.model.captured = seg.captured
            if tree.size:
                r.proposer.commit(tree, path)
            r.stop.update(tree.layout.max_depth, len(path))
        new = toks[: r.max_new_tokens - len(r.out)]
        hit = next((i for i, x in enumerate(new) if x in r.eos), None)
        new = new if hit is None else new[: hit + 1]
        if r.top_logprobs is not None:
            r.logprobs += token_logprobs(logits, tree.size, path, new, r.top_logprobs)
        r.out += new
        r.stats.add_round(tree, path, len(new), draft_s, verify_s, time.perf_counter() - t)
        r.done = hit is not None or len(r.out) >= r.max_new_tokens
        if r.on_tokens and new:
            try:
                r.on_tokens(new)
            except Exception as e:  # the consumer is gone: this request ends, the round goes on
                r.error, r.done = _bare(e), True
        return r.done


def _share_steps(models: Models) -> None:
    """A feature head on the lean step runs a level's rows of every request as one forward: the
    joint budget prices a level so."""
    if models.budget is not None and isinstance(models.draft, FeatureDraft):
        from decoding.drafts.lean_step import shares_steps

        models.budget.shared_draft = shares_steps(models.draft)


def _bare(e: BaseException) -> BaseException:
    """`e` without its traceback and the exceptions it was raised during: their frames hold the
    round's segments and logits, every request's caches with them, and a request keeping its error
    makes a cycle only a full garbage collection frees (a server's memory grew ~40 MiB a fault)."""
    e.__traceback__ = e.__context__ = e.__cause__ = None
    return e


TREE_ROWS = 80
"""Entries a request's cache keeps room for beyond its prompt and new tokens: the tree of its last
round (the default trees grow to 64 nodes) with its pending tokens."""


def reserve_for(model, prompt: int, new_tokens: int) -> int:
    """Entries to reserve in a request's cache (CachedModel.reserve): its prompt, its new tokens
    and a tree, at most the model's context."""
    most = getattr(model.config, "max_position_embeddings", None) or prompt + new_tokens
    return min(prompt + new_tokens, most) + TREE_ROWS


def _chunks_fed(chunks: list[Segment]) -> None:
    """The chunks are in their caches now; a feature head takes in their rows at its next round."""
    for s in chunks:
        s.cache.commit([], 0)
        if isinstance(s.proposer, FeatureProposer):
            s.proposer.model.captured, s.proposer.model.tree_size = s.captured, 0
