"""The host work of a drafted round, timed on the proposer's own code: what the cost curve's
`policy_ms` (a level's warp, top-k and scoring, the draws, the tree bookkeeping) and
`overhead_ms` (a tree round's fixed host cost beyond its forwards and levels: the proposer's
setup, the layout, the tree walk over the verified rows) price.

How: TreeProposer.propose under the grow rule, over a draft whose forward costs nothing (it
returns fixed logits over the target's vocabulary, as a feature head's q is), for a tree of one
node and a fork of `depth` levels (`width` roots, then one child each). A level's host work grows
with its parents (a warp and a top-k over the whole vocabulary each), so it is priced per parent: the fork's extra time over the one
node's, per extra parent; the one-node round less its parent is the fixed cost. The greedy walk
of the tree's rows is timed with it, on logits as large as the target's.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class _FreeDraft:
    """A draft whose forward is free (the logits are made once): what is left of a proposal is
    host work."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def reset(self) -> None:
        pass

    def feed(self, committed, layout, node_tokens, start: int, end: int, hidden: bool = False):
        return self.logits[:max(end - start, 1)], None

    def commit(self, path, fed: int) -> None:
        pass


@torch.inference_mode()
def time_host_work(vocab: int, width: int = 4, depth: int = 4, repeats: int = 5, context: int = 256,
                   device: str | torch.device = "cpu") -> tuple[float, float]:
    """(policy_ms: a level's host work per parent, overhead_ms) on this machine for q over `vocab`
    tokens on `device`: medians over `repeats` interleaved rounds of each tree, the first pass
    dropped (warm-up)."""
    from decoding.acceptance import walk_greedy
    from decoding.forward.cost import CostCurve
    from decoding.gate import DraftGate
    from decoding.growth import GrowPolicy, q_scores
    from decoding.sampling import SamplingConfig, argmax_rows
    from decoding.tree import layout_from_k_config
    from decoding.tree_proposer import TreeProposer

    class Proposer(TreeProposer):
        cache_for = staticmethod(lambda draft: draft)

    depth, width = max(depth, 2), max(width, 2)
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(width, vocab, generator=g)
    logits[torch.arange(width), torch.arange(width) % vocab] += 14.0  # confident: q of ~0.9, every node pays
    verified = torch.randn(1 + width * depth, vocab, generator=g)
    logits, draft = logits.to(device), _FreeDraft(logits.to(device))
    free = CostCurve([1, 1024], [1.0, 1.0], [0.0, 0.0])  # rows and steps free: the envelope is drawn whole
    trees = {}
    for name, env in (("one", (1,)), ("fork", (width,) + (1,) * (depth - 1))):
        trees[name] = (Proposer(draft, layout_from_k_config(env), SamplingConfig()),
                       GrowPolicy(q_scores, free, max_width=width, level_widths=env, gate=DraftGate()))
    committed = [(7 + i) % vocab for i in range(context)]
    gen = torch.Generator(device=device).manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(repeats + 1):
        for name, (prop, pol) in trees.items():
            committed.append((7 + len(committed)) % vocab)
            t = time.perf_counter()
            tree = prop.propose(committed, pol, gen)
            walk_greedy(tree.layout.children, tree.tokens, argmax_rows(verified[:tree.size + 1]))
            times[name].append(1000 * (time.perf_counter() - t))
    one, fork = (float(np.median(times[name][1:])) for name in ("one", "fork"))
    per_parent = max(fork - one, 0.0) / (width * (depth - 1))  # the fork: 1 + width * (depth - 1) parents
    return per_parent, max(one - per_parent, 0.0)
