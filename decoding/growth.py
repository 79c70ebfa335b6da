"""Cost-aware tree growth: the policy decides which frontier nodes get children, how many, and
when the round stops, from a per-node acceptance estimate and the machine's cost curve.

Level by level (EAGLE-2's frontier expansion, with SpecDec++'s cost ratio instead of a fixed
budget): every frontier node offers its top-W draft tokens as candidate children; a candidate's
value is the estimated probability that the whole path down to it is accepted (a node's
expected contribution to the committed length). The level takes the k best candidates that
maximise the round's expected tokens per millisecond,

    rate(k) = (1 + sum of values in the tree + top-k values) / (round cost with k more nodes),

and the round stops when no k beats the current rate (the marginal tokens per extra ms fall
below the rate already reached). The estimate is the draft's own q (the baseline) or a decider.

Exactness: a parent's child count is fixed from its q and what was drawn above it, BEFORE its
children are drawn; under sampling the children are then drawn without replacement as in every
other tree, so the multi-candidate rule stays exact. (Keeping or dropping a sampled child by its
own value would bias the walk: the count may not look at the children it counts.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from decoding.decider.features import TOP_K
from decoding.forward.cost import CostCurve
from decoding.stopping.gate import DraftGate
from decoding.stopping import DraftLevel, Frontier, StopPolicy
from decoding.tree import MAX_TREE_NODES


def candidate_level(fr: Frontier, width: int, features: bool = True) -> DraftLevel:
    """The top-`width` tokens of every frontier node's q as a hypothetical level (what greedy
    would draw), so decider features are computed by the one feature module (`features`: take
    the features' top-10 in the same pass)."""
    own = fr.q_own is not None  # the same top values over the draft's own vocabulary, ids mapped
    q = fr.q_own if own else fr.q
    V = q.shape[-1]
    w = min(width, V)
    top = q.topk(min(max(w, TOP_K if features else 0), V), dim=-1)
    tokens = top.indices[:, :w].reshape(-1).tolist()
    if own:
        tokens = [fr.vocab_ids[t] for t in tokens]
    P = len(fr.nodes)
    parent_of = [r for r in range(P) for _ in range(w)]
    q_tok = top.values[:, :w].reshape(-1)
    base = torch.tensor(fr.path_logq, dtype=torch.float32, device=q_tok.device)[parent_of]
    has_mass = (q_tok > 0).tolist()  # one host read a level, not one a node (each is a sync on a GPU)
    return DraftLevel(
        depth=fr.depth, nodes=list(range(P * w)), tokens=tokens,
        valid=[fr.valid[r] and has_mass[i] for i, r in enumerate(parent_of)],
        q_token=q_tok, parent_q=fr.q, parent_of=parent_of,
        parent_nodes=[fr.nodes[r] for r in parent_of], branch=[b for _ in range(P) for b in range(w)],
        path_logq=base + torch.log(q_tok.float().clamp_min(1e-30)),
        parent_hidden=fr.hidden, position=fr.position,
        prefixes=None if fr.paths is None else [fr.paths[r] for r in parent_of], context=fr.context,
        # only a full top-10 may stand in for the features' own top-k
        parent_top=top.values if top.values.shape[-1] >= min(TOP_K, V) else None,
    )


def child_values(parent_value: list[float], parent_of: list[int], valid: list[bool],
                 scores) -> list[float]:
    """Path values of a level's nodes: parent's value x the node's acceptance estimate, with
    siblings capped in draw order so their sum never exceeds the parent's (at most one sibling
    is accepted). `parent_of[i]` indexes `parent_value`; nodes come in draw order per parent."""
    out, used = [], {}
    scores = scores.tolist() if isinstance(scores, torch.Tensor) else scores
    for i, (r, ok) in enumerate(zip(parent_of, valid)):
        pv = parent_value[r]
        v = max(min(pv * float(scores[i]), pv - used.get(r, 0.0)), 0.0) if ok else 0.0
        used[r] = used.get(r, 0.0) + v
        out.append(v)
    return out


def pooled(values: list[float]) -> list[float]:
    """One parent's sibling values (draw order) made non-increasing by pooling adjacent
    violators: the slopes of the concave majorant of their prefix sums. A later sibling can only
    be drafted with every earlier one, so a block whose average beats what precedes it is
    worth taking whole (a decider may rate the second draw above the first; q never does)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def pooled_keys(values: list[float], parent_of: list[int]) -> list[float]:
    """Each candidate's pooled value (`pooled` per parent, draw order kept)."""
    by_parent: dict[int, list[int]] = {}
    for i, r in enumerate(parent_of):
        by_parent.setdefault(r, []).append(i)
    key = [0.0] * len(values)
    for rows in by_parent.values():
        for i, v in zip(rows, pooled([values[i] for i in rows])):
            key[i] = v
    return key


def candidate_order(values: list[float], parent_of: list[int], branch: list[int]) -> list[int]:
    """Candidates in the order the level considers them: by pooled value, so the first k of
    the order always take a prefix of every parent's draws (what the engine can draw); those
    worth nothing are left out."""
    key = pooled_keys(values, parent_of)
    return sorted((i for i in range(len(values)) if key[i] > 0.0), key=lambda i: (-key[i], branch[i], parent_of[i]))


def rate(cost, value: float, nodes: int, feeds: float) -> float:
    """Expected tokens per ms of a round: `value` expected committed tokens, a tree of `nodes`
    verified with the pending token, `feeds` ms of draft steps and level host work so far, and a
    tree round's fixed host cost once the tree has a node (an empty tree verifies one row)."""
    return value / (float(cost.target(nodes + 1)) + feeds + (cost.overhead_ms if nodes else 0.0))


def best_count(values: list[float], E: float, N: int, feeds: float, cost, room: int) -> int:
    """How many of the candidates (`values` in `candidate_order`) the level takes: the k that
    maximises the round's rate with them; 0 (stop) when no k beats the rate already reached."""
    best_k, best, gained = 0, rate(cost, E, N, feeds), 0.0
    for k, v in enumerate(values[:max(room, 0)], start=1):
        gained += v
        r = rate(cost, E + gained, N + k, feeds)
        if r > best:
            best_k, best = k, r
    return best_k


def worth_a_level(guess: list[float], E: float, N: int, feeds: float, next_feeds: float,
                  cost, room: int) -> bool:
    """Draft one level deeper? Only if some prefix of the guessed child values (descending)
    would raise the rate after paying `next_feeds` (the draft forward that feeds the level)."""
    now, gained = rate(cost, E, N, feeds), 0.0
    for k, g in enumerate(guess[:max(room, 0)], start=1):
        gained += g
        if rate(cost, E + gained, N + k, next_feeds) > now:
            return True
    return False


@dataclass
class GrowPolicy(StopPolicy):
    """Grow the draft tree node by node where the expected tokens per ms say it pays."""

    scorer: Callable[[DraftLevel], torch.Tensor]
    """[k] estimated acceptance probability of each node of a level (q, or a decider's)."""
    cost: CostCurve
    max_width: int = 4
    """Most children a node may get."""
    max_nodes: int = 64
    """Cap on the tree size (no other budget: the cost curve decides)."""
    level_widths: tuple[int, ...] | None = None
    """Most children per node at each depth (a k-config: the envelope the tree grows within,
    e.g. a fork 4,1,1,... whose traces replay the policy exactly); None: max_width at every depth."""
    label: str = "q"
    name: str = "grow"
    needs_hidden: bool = False
    sizes_children = True
    gate: DraftGate = field(default_factory=DraftGate)
    """Whether a round drafts at all, before its first draft step (decoding.stopping)."""
    _round: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not 1 <= self.max_width <= 64:
            raise ValueError(f"grow max width must be in 1..64 (got {self.max_width})")
        if not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"--max-nodes must be in 1..{MAX_TREE_NODES} (got {self.max_nodes})")

    def drafts(self, context: int) -> bool:
        """Does this round draft at all (`context`: cached tokens)? The gate's call, made before
        the draft's first step: a skipped round is a plain step, with no draft step paid."""
        self._round = {}
        return self.gate.drafts(self.cost.at_context(context), context=context)

    def timed(self, drafted: bool, ms: float, behind_ms: float = 0.0) -> None:
        self.gate.timed(drafted, ms, behind_ms)

    def lookahead(self) -> int:
        return self.gate.lookahead()

    def update(self, drafted_depth: int, accepted_depth: int) -> None:
        """A round was verified: a drafted one (its first level sized) goes to the gate's history
        with the tokens it committed and the shape it paid for."""
        st, self._round = self._round, {}
        if "N" in st:
            self.gate.record(1 + accepted_depth, st["N"], st["sizes"], st["parents"])

    def widths(self, fr: Frontier) -> list[int]:
        if fr.depth == 1:  # a new round: only the pending token is sure to be committed
            cost = self.cost.at_context(fr.context.upto) if fr.context is not None else self.cost
            # the anchor's step and this level's host work (one parent); expand adds each
            # deeper level's, per parent
            self._round = {"value": {-1: 1.0}, "E": 1.0, "N": 0, "cost": cost,
                           "feeds": cost.draft(2) + cost.policy_ms, "sizes": [2], "parents": 0}
        st = self._round
        cost = st.get("cost", self.cost)
        width = self.max_width
        if self.level_widths is not None:
            width = min(width, self.level_widths[fr.depth - 1] if fr.depth <= len(self.level_widths) else 0)
        if width < 1:
            return [0] * len(fr.nodes)
        cand = candidate_level(fr, width, features=self.label != "q")
        scores = self.scorer(cand)
        st["seen"] = {(p, t, b): float(x) for p, t, b, x in
                      zip(cand.parent_nodes, cand.tokens, cand.branch, scores.tolist())}
        vals = child_values([st["value"].get(n, 0.0) for n in fr.nodes], cand.parent_of, cand.valid, scores)
        order = candidate_order(vals, cand.parent_of, cand.branch)
        feeds = st["feeds"]
        room = min(self.max_nodes, MAX_TREE_NODES) - st["N"]
        best_k = best_count([vals[i] for i in order], st["E"], st["N"], feeds, cost, room)
        counts = [0] * len(fr.nodes)
        for i in order[:best_k]:
            counts[cand.parent_of[i]] += 1
        st["feeds"] = feeds
        st["N"] += best_k
        st["parents"] = st.get("parents", 0) + len(fr.nodes)
        return counts

    def expand(self, level: DraftLevel) -> list[bool]:
        """After drawing: record the drawn nodes' values; go one level deeper only if a level
        whose nodes are worth this level's values times their own scores would raise the rate
        after paying the draft forward that feeds this level and the next level's host work."""
        st = self._round
        pv = {r: st["value"].get(p, 0.0) for r, p in zip(level.parent_of, level.parent_nodes)}
        scores = self._scores(level)
        vals = child_values([pv.get(r, 0.0) for r in range(len(level.parent_q))], level.parent_of,
                            level.valid, scores)
        st["value"].update(zip(level.nodes, vals))
        st["E"] += sum(vals)
        guess = sorted((v * float(s) for v, s in zip(vals, scores.tolist())), reverse=True)
        cost = st.get("cost", self.cost)
        n = max(len(level.nodes), 1)  # the next level's parents
        next_feeds = st["feeds"] + cost.draft(n) + n * cost.policy_ms
        go = worth_a_level(guess, st["E"], st["N"], st["feeds"], next_feeds, cost, self.max_nodes - st["N"])
        if go:  # the round pays that forward: every later rate counts it
            st["feeds"] = next_feeds
            st.setdefault("sizes", [2]).append(n)
        return [go and ok and v > 0.0 for ok, v in zip(level.valid, vals)]

    def _scores(self, level: DraftLevel) -> torch.Tensor:
        """A drawn node with the token and draw order of a scored candidate has the same
        features: reuse its score (always the case under greedy) instead of a second pass."""
        seen = self._round.get("seen", {})
        keys = [(p, t, b) for p, t, b in zip(level.parent_nodes, level.tokens, level.branch)]
        if all(k in seen for k in keys):
            return torch.tensor([seen[k] for k in keys])
        return self.scorer(level)


def q_scores(level: DraftLevel) -> torch.Tensor:
    """The baseline estimate: the draft's own probability of each node's token."""
    return level.q_token.float().cpu()


# ---- the host work a level and a round cost (the curve's policy_ms and overhead_ms) ----
# The host work of a drafted round, timed on the proposer's own code: what the cost curve's
# `policy_ms` (a level's warp, top-k and scoring, the draws, the tree bookkeeping) and
# `overhead_ms` (a tree round's fixed host cost beyond its forwards and levels: the proposer's
# setup, the layout, the tree walk over the verified rows) price.
#
# How: TreeProposer.propose under the grow rule, over a draft whose forward costs nothing (it
# returns fixed logits over the target's vocabulary, or over a feature head's own columns, which
# the proposer scatters to the target's), for a tree of one node and a fork of `depth` levels
# (`width` roots, then one child each). A level's host work grows with its parents (a warp and a
# top-k over the draft's vocabulary each), so it is priced per parent: the fork's extra time over the one
# node's, per extra parent; the one-node round less its parent is the fixed cost. The greedy walk
# of the tree's rows is timed with it, on logits as large as the target's.


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
                   device: str | torch.device = "cpu", own: int | None = None) -> tuple[float, float]:
    """(policy_ms: a level's host work per parent, overhead_ms) on this machine for q over `vocab`
    tokens on `device` (drawn over `own` of them where the draft has a vocabulary of its own):
    medians over `repeats` interleaved rounds of each tree, the first pass dropped (warm-up)."""
    from decoding.acceptance import walk_greedy
    from decoding.forward.cost import CostCurve
    from decoding.sampling import SamplingConfig, argmax_rows
    from decoding.tree import layout_from_k_config
    from decoding.tree_proposer import TreeProposer

    depth, width = max(depth, 2), max(width, 2)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = None if own is None else torch.randperm(vocab, generator=g)[:own].sort().values.to(device)

    class Proposer(TreeProposer):
        cache_for = staticmethod(lambda draft: draft)

    cols = vocab if own is None else own
    logits = torch.randn(width, cols, generator=g)
    logits[torch.arange(width), torch.arange(width) % cols] += 14.0  # confident: q of ~0.9, every node pays
    verified = torch.randn(1 + width * depth, vocab, generator=g)
    logits, draft = logits.to(device), _FreeDraft(logits.to(device))
    free = CostCurve([1, 1024], [1.0, 1.0], [0.0, 0.0])  # rows and steps free: the envelope is drawn whole
    trees = {}
    for name, env in (("one", (1,)), ("fork", (width,) + (1,) * (depth - 1))):
        trees[name] = (Proposer(draft, layout_from_k_config(env), SamplingConfig()),
                       GrowPolicy(q_scores, free, max_width=width, level_widths=env, gate=DraftGate()))
        if ids is not None:  # as a feature head's proposer
            trees[name][0].set_vocab(ids, vocab)
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
