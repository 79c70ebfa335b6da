"""The models a request decodes with, fixed when it joins: its draft and its stop policy (or the
joint budget's scorer).

Why a record per request: a server swaps in a promoted head or decider while requests run
(decoding.serve.reload). A request's draft cache and tree statistics belong to the draft that
built them, so a request in flight finishes on the models it started with, and only requests
admitted after the swap use the new ones. Two heads can then be live at once; the old one is
freed when the last request bound to it leaves (nothing else holds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.batch.budget import JointGrow
from decoding.stopping import FixedDepth, StopPolicy


@dataclass(frozen=True)
class Models:
    """One version of the engine's swappable models."""

    draft: torch.nn.Module | None = None
    """The draft its proposer is built from (None: plain decoding)."""
    stop: Callable[[], StopPolicy] = FixedDepth
    """A factory of its own stop policy (independent trees)."""
    budget: JointGrow | None = None
    """The joint budget it was admitted under: its scorer, label and needs_hidden score this
    request's nodes; a round's cost and limits come from the engine's current budget."""
    version: int = 0
    """0 for the models the engine was built with, +1 per swap."""


def check_swap(old: Models, new: Models) -> None:
    """ValueError unless `new` can replace `old` in a running engine: the same kind of run (a draft
    or none, a joint budget or per-request stop policies), as the engine's layout and verify assume."""
    if (old.draft is None) != (new.draft is None):
        raise ValueError("a swap keeps the engine's kind: a draft for a draft (plain decoding has none)")
    if (old.budget is None) != (new.budget is None):
        raise ValueError("a swap keeps the engine's kind: a joint budget for a joint budget")
