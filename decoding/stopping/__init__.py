"""Stop policies: after each drafted level, decide whether to draft one more.

They read only draft-side information, so they change how much is drafted and never what
is committed: every policy is lossless under a lossless acceptance rule.
Interface (like transformers' CandidateGenerator): `drafts(context)` may skip a round's draft
altogether (a plain step; decoding.stopping.gate), `widths(frontier)` may set how many children
each frontier node gets (decoding.growth; default: the tree layout's), `expand(level)` during
drafting says which nodes of the level just drafted get children (none: drafting ends; the default asks
`should_stop` and extends the whole level), and `update(drafted_depth, accepted_depth)` once
the round is verified. A node's children are decided from information up to the node
itself, and every drafted node is verified, so sampling stays exact.
"""

from __future__ import annotations


from dataclasses import dataclass

import torch

from decoding.decider.context import Snapshot
from decoding.options import CONFIDENCE_RULES, GROW, check_threshold  # noqa: F401 (re-exported)


@dataclass
class DraftLevel:
    """What was just drafted: one tree level, seen by stop policies and decider features."""

    depth: int
    nodes: list[int]
    tokens: list[int]
    valid: list[bool]
    q_token: torch.Tensor
    """[k] draft probability of each node's token under its parent's distribution."""
    parent_q: torch.Tensor
    """[P, V] the distributions this level was drawn from, one row per parent."""
    parent_of: list[int]
    """[k] row of parent_q each node was drawn from."""
    parent_nodes: list[int]
    """[k] parent node id of each node (-1 = the anchor)."""
    branch: list[int]
    """[k] draw order of each node among its siblings (0 = first candidate)."""
    path_logq: torch.Tensor
    """[k] cumulative log q of the path from the anchor down to each node."""
    parent_hidden: torch.Tensor | None = None
    """[P, H] draft last-layer hidden state at each parent (when a policy asks for it)."""
    position: int = 0
    """Number of tokens generated so far in this request."""
    prefixes: list[tuple[int, ...]] | None = None
    """[k] each node's ancestors' tokens, anchor side first (for decoding.decider.context)."""
    context: Snapshot | None = None
    """The committed text as this level saw it (decoding.decider.context; None: no context columns)."""
    parent_top: torch.Tensor | None = None
    """[P, >= 10] each parent's largest q values, descending, where the level's maker already
    took them (decoding.growth's candidates): the features reuse them instead of a second top-k."""


@dataclass
class Frontier:
    """The nodes whose children are about to be drawn, once the draft has read them."""

    depth: int
    """Depth of the children to be drawn (1 = the anchor's)."""
    nodes: list[int]
    """Parent node ids (-1 = the anchor)."""
    q: torch.Tensor
    """[P, V] each parent's (warped) draft distribution."""
    path_logq: list[float]
    """Cumulative log q from the anchor down to each parent (0 for the anchor)."""
    valid: list[bool]
    size: int
    """Nodes drafted so far this round."""
    hidden: torch.Tensor | None = None
    """[P, H] draft hidden state at each parent (when a policy asks for it)."""
    position: int = 0
    paths: list[tuple[int, ...]] | None = None
    """[P] tokens from the anchor's first child down to each parent (() for the anchor)."""
    context: Snapshot | None = None
    q_own: torch.Tensor | None = None
    """[P, N] the same q over the draft's own vocabulary, where it has one (its top tokens are
    found over N entries, not V)."""
    vocab_ids: list[int] | None = None
    """Target id of each of q_own's columns."""


class StopPolicy:
    name = "fixed"
    needs_hidden = False
    sizes_children = False
    """True: `widths` chooses every node's child count (the tree layout only caps the depth)."""

    def drafts(self, context: int) -> bool:
        """Does this round draft at all (`context`: cached tokens)? Asked before the draft's first
        step; False: a plain round (decoding.stopping.gate). Must read only earlier rounds."""
        return True

    def timed(self, drafted: bool, ms: float, behind_ms: float = 0.0) -> None:
        """The round just run took `ms` on the wall (`drafted`: `drafts` said yes), `behind_ms` of
        it catching the draft up on skipped rounds (TreeProposer.behind_ms); steady rounds only,
        none feeding a prompt. A policy that prices rounds calibrates on it."""

    def lookahead(self) -> int:
        """After `drafts` said no: plain rounds that will follow this one before a round may draft
        again (0: the next may). A feature head skips the target's features that far ahead."""
        return 0

    def widths(self, frontier: Frontier) -> list[int] | None:
        """Children to draw under each frontier node (None: as many as the tree layout has).
        Must depend only on what was drawn so far, never on the children it counts."""
        return None

    def should_stop(self, level: DraftLevel) -> bool:
        return False

    def expand(self, level: DraftLevel) -> list[bool]:
        """Per node of `level`: draft its children next? (all False: stop drafting)."""
        return [not self.should_stop(level)] * len(level.nodes)

    def update(self, drafted_depth: int, accepted_depth: int) -> None:
        pass


class FixedDepth(StopPolicy):
    """Always draft the whole tree (classic speculative decoding / MCSD)."""


@dataclass
class DraftConfidence(StopPolicy):
    """Hugging Face assisted generation's rule: stop once the draft's own probability of
    its token falls below a threshold (on a tree: below it on every branch of the level)."""

    threshold: float = 0.4
    rule: str = "level"
    """level: HF's rule (a level continues while some node has q >= threshold); tree: extend
    each node while the draft probability of its whole path is >= threshold (a dynamic
    tree from the draft's own confidence, as EAGLE-2 grows one); grow: decoding.growth."""
    name = "confidence"

    def __post_init__(self):
        if self.rule not in CONFIDENCE_RULES or self.rule == GROW:
            raise ValueError(f"confidence rule must be one of {CONFIDENCE_RULES} (got {self.rule!r})")

    def should_stop(self, level: DraftLevel) -> bool:
        ok = level.q_token[torch.tensor(level.valid, device=level.q_token.device)]
        return ok.numel() == 0 or float(ok.max()) < self.threshold

    def expand(self, level: DraftLevel) -> list[bool]:
        if self.rule == "level":
            return super().expand(level)
        keep = level.path_logq.exp() >= self.threshold
        return [bool(k) and v for k, v in zip(keep, level.valid)]


def make_stop_policy(name: str, threshold: float | None = None, rule: str = "level") -> StopPolicy:
    """Policies that need no checkpoint; `decider` is built by Session (it needs the models)."""
    if name == "fixed":
        return FixedDepth()
    if name == "confidence" and rule == GROW:
        raise ValueError("the grow rule needs a measured cost model: build it with Session.engine "
                         "(it reads the one stored with a decider checkpoint)")
    if name == "confidence":
        return DraftConfidence(0.4 if threshold is None else threshold, rule)
    raise ValueError(f"unknown stop policy {name!r}; choose fixed, confidence or decider")
