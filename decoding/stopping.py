"""Stop policies: after each drafted level, decide whether to draft one more.

They read only draft-side information, so they change how much is drafted and never what
is committed: every policy is lossless under a lossless acceptance rule.
Interface (like transformers' CandidateGenerator): `should_stop(level)` during drafting and
`update(drafted_depth, accepted_depth)` once the round is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """[k, V] the distribution each token was drawn from (rows repeat for siblings)."""
    path_logq: torch.Tensor
    """[k] cumulative log q of the path from the anchor down to each node."""
    parent_hidden: torch.Tensor | None = None
    """[k, H] draft last-layer hidden state that produced each token (when requested)."""
    position: int = 0
    """Number of tokens generated so far in this request."""


class StopPolicy:
    name = "fixed"
    needs_hidden = False

    def should_stop(self, level: DraftLevel) -> bool:
        return False

    def update(self, drafted_depth: int, accepted_depth: int) -> None:
        pass


class FixedDepth(StopPolicy):
    """Always draft the whole tree (classic speculative decoding / MCSD)."""


@dataclass
class DraftConfidence(StopPolicy):
    """Hugging Face assisted generation's rule: stop once the draft's own probability of
    its token falls below a threshold (on a tree: below it on every branch of the level)."""

    threshold: float = 0.4
    name = "confidence"

    def should_stop(self, level: DraftLevel) -> bool:
        ok = level.q_token[torch.tensor(level.valid)]
        return ok.numel() == 0 or float(ok.max()) < self.threshold


def make_stop_policy(name: str, threshold: float | None = None, decider: str | None = None) -> StopPolicy:
    if name == "fixed":
        return FixedDepth()
    if name == "confidence":
        return DraftConfidence(0.4 if threshold is None else threshold)
    if name == "decider":
        raise ValueError("--stop decider needs a trained decider (--decider DIR); none is available yet")
    raise ValueError(f"unknown stop policy {name!r}; choose fixed, confidence or decider")
