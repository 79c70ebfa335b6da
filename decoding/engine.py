"""The speculative decoding loop: propose -> verify -> decide -> commit.

Batch size 1. The target's cache holds every committed token but the newest ("pending"),
which is fed together with the next tree, so a round costs exactly one target forward and
`ar` is the same loop with an empty tree.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from decoding import acceptance as acc
from decoding.batch.forward import feed_one
from decoding.forward.static import cached_model
from decoding.tree_proposer import DraftTree, TreeProposer, empty_tree
from decoding.sampling import SamplingConfig, argmax_rows, warp
from decoding.run_stats import RunStats
from decoding.stopping import FixedDepth, StopPolicy


@dataclass
class Outcome:
    path: list[int]
    tokens: list[int]
    anchor_p: torch.Tensor | None = None


class SpeculativeEngine:
    def __init__(self, target, proposer: TreeProposer | None, sampling: SamplingConfig,
                 stop: StopPolicy | None = None, replacement: bool = False,
                 longest_branch: bool = False, name: str = "ar"):
        self.target = cached_model(target)
        self.proposer = proposer
        self.sampling = sampling
        self.stop = stop or FixedDepth()
        self.replacement = replacement
        self.longest_branch = longest_branch
        self.name = name
        self.observer = None
        """Optional callable(tree, target_logits, outcome, position) after each verified round
        (trace collection); with `observer.hidden` set the draft also returns hidden states."""
        self.commit_limit: int | None = None
        """Commit at most this many tokens a round (trace collection: 1 starts a round at every
        position, so a replay can follow any policy's own rounds). The committed text keeps its
        law: a prefix of a lossless outcome is a lossless draw."""

    @property
    def lossless(self) -> bool:
        return not self.longest_branch

    def generate(self, prompt_ids, max_new_tokens: int = 128, eos_token_id=None, seed: int = 0,
                 on_tokens=None) -> tuple[list[int], RunStats]:
        gen = torch.Generator(device=self.target.model.device).manual_seed(seed)
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        self.target.reset()
        if self.proposer:
            self.proposer.reset()
        committed, n0 = list(prompt_ids), len(prompt_ids)
        stats = RunStats(self.name, self.lossless)
        anchor_p = None
        t_start = time.perf_counter()
        while len(committed) - n0 < max_new_tokens:
            t0 = time.perf_counter()
            tree = self._propose(committed, gen, anchor_p, len(committed) - n0)  # propose
            t1 = time.perf_counter()
            with self._verifying():
                logits = feed_one(self.target, committed, tree.layout, tree.tokens)          # verify
            t2 = time.perf_counter()
            out = self._decide(tree, logits, gen)                                      # decide
            if self.observer is not None and tree.size:
                self.observer(tree, logits, out, len(committed) - n0)
            if self.commit_limit is not None and len(out.tokens) > self.commit_limit:
                k = self.commit_limit  # the k-th token stays pending, as a bonus token does
                out = Outcome(out.path[:k - 1], out.tokens[:k], None)
            self.target.commit(out.path, tree.size)                                    # commit
            if self.proposer and tree.size:
                self.proposer.commit(tree, out.path)
            self.stop.update(tree.layout.max_depth, len(out.path))
            anchor_p = out.anchor_p
            new = out.tokens[: max_new_tokens - (len(committed) - n0)]
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            new = new if hit is None else new[: hit + 1]
            committed += new
            stats.add_round(tree, out.path, len(new), t1 - t0, t2 - t1, time.perf_counter() - t2)
            if self.proposer is not None and stats.rounds > 1:  # a steady round (the first fed the prompt)
                self.stop.timed(self._drafted, 1000 * (time.perf_counter() - t0),
                                self.proposer.behind_ms if self._drafted else 0.0)
            if on_tokens and new:
                on_tokens(new)
            if hit is not None:
                break
        stats.wall_s = time.perf_counter() - t_start
        stats.context = len(committed)
        head = getattr(getattr(self.proposer, "model", None), "draft", None)  # a feature head records its window
        stats.trained_window = getattr(head, "trained_window", None)
        return committed[n0:], stats

    def _verifying(self):
        """A feature draft captures the target's hidden states during verification."""
        hook = getattr(self.proposer, "verifying", None)
        return hook() if hook is not None else nullcontext()

    def _propose(self, committed, gen, anchor_p, position) -> DraftTree:
        self._drafted = False
        if self.proposer is None or (self.longest_branch and anchor_p is None):
            return empty_tree()
        self._drafted = self.stop.drafts(len(committed))
        if not self._drafted:  # a plain round: no draft step, one row
            self.proposer.plain(self.stop.lookahead(), len(committed))
            return empty_tree()
        hidden = self.stop.needs_hidden or getattr(self.observer, "hidden", False)
        return self.proposer.propose(committed, self.stop, gen, anchor_p, position, hidden)

    def _decide(self, tree: DraftTree, logits: torch.Tensor, gen) -> Outcome:
        """Walk the verified tree. logits[-size-1] is the anchor's row when the anchor was
        pending (lossless); node i's row is logits[-size + i]."""
        n = tree.size
        node_row = lambda i: logits[len(logits) - n + i] if i >= 0 else logits[len(logits) - n - 1]  # noqa: E731
        p_at = lambda i: warp(node_row(i), self.sampling)  # noqa: E731
        q_at = tree.q.__getitem__
        ch = tree.layout.children
        if self.longest_branch:
            if n == 0:  # first round only reads the prompt
                return Outcome([], [], p_at(-1))
            argmax = [-1] + argmax_rows(logits[-n:])
            w = acc.longest_branch(ch, tree.tokens, self.sampling.greedy, argmax, p_at, q_at, gen)
            return Outcome(w.path, [tree.tokens[i] for i in w.path], p_at(w.path[-1]))
        if self.sampling.greedy:
            w = acc.walk_greedy(ch, tree.tokens, argmax_rows(logits[-n - 1:]))
        else:
            w = acc.walk_sampling(ch, tree.tokens, tree.valid, p_at, q_at, self.replacement, gen)
        return Outcome(w.path, [tree.tokens[i] for i in w.path] + [w.next_token])

