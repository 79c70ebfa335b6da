"""Replay recorded traces under a cost model: what tokens/s would a stop policy have given?

Each collected round drafted the full tree. A stop policy keeps a sub-tree of it: every
level-1 node (drawn together from the anchor) and, below, the children of the nodes it chose
to extend. Greedy acceptance inside a kept sub-tree equals the full tree's accepted path cut
at the first node that was not kept, so the round would have committed
1 + (accepted nodes kept) tokens at cost
    draft(pending) + sum over kept levels l < L of draft(kept nodes at l)   (one draft call per level)
    + target(pending + kept nodes) + overhead + L * policy cost
where L is the deepest kept level (the engine feeds the draft every node of a level, extended
or not). Rounds are treated independently, as SpecDec++'s analysis does. A policy is a
function ReplaySet -> kept mask over the trace rows; everything here is vectorised.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from decoding.decider.features import FEATURE_NAMES
from decoding.forward.cost import COST_SIZES, NODES, TOKENS, at, monotone  # noqa: F401  (monotone re-exported)

Q_TOKEN = FEATURE_NAMES.index("q_token")
PATH_LOGQ = FEATURE_NAMES.index("path_logq")


@dataclass
class CostModel:
    """Milliseconds per forward as a function of the number of new tokens fed (interpolated)."""

    sizes: list[int] = field(default_factory=lambda: list(COST_SIZES))
    target_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    overhead_ms: float = 0.0
    """Engine bookkeeping per round outside the forwards (drawing candidates, acceptance walk,
    cache commit); `calibrate` measures it."""
    policy_ms: float = 0.0
    """Stop-policy cost per drafted level (decider inference)."""
    source: dict[str, str] = field(default_factory=dict)
    """Where each cost came from (field -> how it was obtained, on which machine/pair)."""
    unit: str = NODES
    """What a size counts: tokens (new tokens fed, the pending one included: every curve
    `calibrate` times) or nodes (a curve stored before 2026-11-26, which carries no unit and
    was timed with one token more than its size; read one size lower)."""

    def target(self, n):
        return at(n, self.sizes, self.target_ms, self.unit)

    def draft(self, n):
        return at(n, self.sizes, self.draft_ms, self.unit)


@torch.inference_mode()
def calibrate(target, draft, context: int = 256, repeats: int = 5, sizes=None,
              collect: dict | None = None, overhead_tokens: int = 32) -> CostModel:
    """Measure this machine: forward times for each tree size (sizes interleaved within each
    repeat, so a burst of load hits several sizes once, not one size every time; median of
    `repeats`, then made monotone), and the engine's per-round bookkeeping (`overhead_ms`)."""
    from decoding.forward.cost import time_forwards

    cm = CostModel(**({"sizes": sizes} if sizes else {}), unit=TOKENS)
    vocab = target.get_output_embeddings().weight.shape[0]
    prompt = [(10 + i) % vocab for i in range(context)]
    cm.target_ms = time_forwards(target, cm.sizes, repeats, context)
    cm.draft_ms = time_forwards(draft, cm.sizes, repeats, context, verify=False)
    cm.overhead_ms, how = bookkeeping_ms(target, draft, prompt, repeats, collect, overhead_tokens)
    where = f"measured on {platform.node() or 'this machine'} ({torch.get_num_threads()} threads)"
    cm.source = {"target_ms": f"{where}: median CachedModel.feed of {context} + n tokens, "
                              f"{repeats} repeats, made monotone",
                 "draft_ms": f"{where}: as target_ms, for the draft",
                 "overhead_ms": f"{where}: {how}",
                 "policy_ms": "not measured here: deciders add their own inference time"}
    return cm


def bookkeeping_ms(target, draft, prompt, repeats: int = 5, collect: dict | None = None,
                   new_tokens: int = 32) -> tuple[float, str]:
    """Median per-round engine time outside the target's and draft's forwards: generate with
    the tree the traces were collected with (`collect`: the trace manifest's collect block) and
    subtract the time spent inside `CachedModel.feed`, which the forward costs already charge."""
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    c = {"strategy": "ti-mcsd", "width": 4, "depth": 6, "temperature": 0.0} | (collect or {})
    keys = ("strategy", "width", "depth", "k_config", "gamma")
    scfg = StrategyConfig(**{k: c[k] for k in keys if c.get(k) is not None})
    if scfg.strategy == "ar":
        scfg = StrategyConfig("mcsd")  # a drafting strategy: ar has no draft steps to time
    sampling = SamplingConfig(float(c.get("temperature") or 0.0), float(c.get("top_p") or 1.0))
    engine = build_engine(target, draft, scfg, sampling)
    in_feed = [0.0]
    for cached in (engine.target, engine.proposer.model):
        def timed(*a, _feed=cached.feed, **k):
            t = time.perf_counter()
            try:
                return _feed(*a, **k)
            finally:
                in_feed[0] += time.perf_counter() - t
        cached.feed = timed
    per_round = []
    for r in range(repeats + 1):  # the first run warms up and is dropped
        in_feed[0] = 0.0
        _, stats = engine.generate(prompt[:64], max_new_tokens=new_tokens, seed=r)
        if r:
            per_round.append(1000 * max(0.0, stats.wall_s - in_feed[0]) / max(stats.rounds, 1))
    how = (f"median over {repeats} generations of ({scfg.name}, T={sampling.temperature}, "
           f"{new_tokens} tokens) wall time minus time in the forwards, per round")
    return float(np.median(per_round)), how


class ReplaySet:
    """The rounds of a trace table as flat arrays: round id, depth, parent row, acceptance."""

    def __init__(self, table):
        col = lambda c: table.column(c).to_numpy(zero_copy_only=False)
        pid, rnd, node, parent = col("prompt_id"), col("round"), col("node"), col("parent")
        self.depth = col("depth").astype(np.int64)
        self.accepted = col("accepted").astype(bool)
        self.valid = col("valid").astype(bool)
        key = np.char.add(pid.astype(str), np.char.add(":", rnd.astype(str)))
        _, self.rid = np.unique(key, return_inverse=True)
        self.rounds = int(self.rid.max()) + 1 if len(self.rid) else 0
        self.max_depth = int(self.depth.max()) if len(self.depth) else 0
        # parent row of every node (-1 for level 1): rows are unique per (round, node)
        where = {(r, n): i for i, (r, n) in enumerate(zip(self.rid.tolist(), node.tolist()))}
        self.parent_row = np.array([where[(r, p)] if p >= 0 else -1
                                    for r, p in zip(self.rid.tolist(), parent.tolist())], dtype=np.int64)
        self.round_depth = np.zeros(self.rounds, np.int64)
        np.maximum.at(self.round_depth, self.rid, self.depth)
        self.round_accepted = np.bincount(self.rid, weights=self.accepted, minlength=self.rounds)
        self._levels = [np.flatnonzero(self.depth == d) for d in range(1, self.max_depth + 1)]
        # which level-1 candidate each node descends from (0 = the draft's first choice)
        self.branch = col("branch").astype(np.int64)
        self.chain = self.branch.copy()
        for rows in self._levels[1:]:
            self.chain[rows] = self.chain[self.parent_row[rows]]
        if "position" in table.column_names:
            self._walk_table(pid, col("position").astype(np.int64))
        else:
            self.at = None

    def _walk_table(self, pid, position) -> None:
        """`at[prompt, offset]` = the round that starts `offset` tokens after the prompt's first
        round. Where every prompt has a round at every position from its first on (`collect
        --every-position`), `run` walks each policy's own rounds: from the first, the next round
        starts after what this one commits, as deployment runs them (the rounds a recorded full
        tree left start only after its rejections)."""
        self.at = None
        if not self.rounds:
            return
        _, prompt = np.unique(pid.astype(str), return_inverse=True)
        rp, rpos = np.zeros(self.rounds, np.int64), np.zeros(self.rounds, np.int64)
        rp[self.rid], rpos[self.rid] = prompt, position
        first = np.full(int(rp.max()) + 1, np.iinfo(np.int64).max)
        np.minimum.at(first, rp, rpos)
        rpos -= first[rp]  # a prompt's first round (a feature draft's first reads the prompt only)
        at = np.full((int(rp.max()) + 1, int(rpos.max()) + 1), -1, np.int64)
        at[rp, rpos] = np.arange(self.rounds)
        starts = (at >= 0).sum(1)
        if ((at >= 0) == (np.arange(at.shape[1])[None] < starts[:, None])).all():  # 0..n-1 each
            self.at = at

    @property
    def walks(self) -> bool:
        """Does `run` follow each policy's own rounds (a round at every position)?"""
        return self.at is not None

    def visited(self, accepted: np.ndarray) -> np.ndarray:
        """[rounds] bool: the rounds a policy that accepts `accepted[r]` drafted tokens in round r
        runs, walking every prompt from its first round (all rounds when the traces cannot walk)."""
        if self.at is None:
            return np.ones(self.rounds, bool)
        seen = np.zeros(self.rounds, bool)
        cur = np.zeros(len(self.at), np.int64)
        live = np.flatnonzero(self.at[:, 0] >= 0)
        while len(live):
            r = self.at[live, cur[live]]
            seen[r] = True
            cur[live] += accepted[r].astype(np.int64) + 1
            live = live[cur[live] < self.at.shape[1]]
            live = live[self.at[live, cur[live]] >= 0]
        return seen

    def __len__(self) -> int:
        return self.rounds

    # --- building blocks of policies -------------------------------------------------------
    def path(self, scores: np.ndarray) -> np.ndarray:
        """Product of per-node scores from level 1 down to each node."""
        out = np.asarray(scores, np.float64).copy()
        for rows in self._levels[1:]:
            out[rows] *= out[self.parent_row[rows]]
        return out

    def level_any(self, mask: np.ndarray) -> np.ndarray:
        """[rounds, max_depth] bool: some row of that round and level satisfies `mask`."""
        m = np.zeros((self.rounds, self.max_depth + 1), bool)
        m[self.rid[mask], self.depth[mask]] = True
        return m[:, 1:]

    def keep_depth(self, stop_depth: np.ndarray) -> np.ndarray:
        return self.depth <= np.maximum(1, stop_depth)[self.rid]

    def first_stop(self, stop: np.ndarray) -> np.ndarray:
        """Per round: the first depth whose `stop` [rounds, max_depth] is true, else the full depth."""
        hit = stop & (np.arange(1, self.max_depth + 1)[None] <= self.round_depth[:, None])
        return np.where(hit.any(1), hit.argmax(1) + 1, self.round_depth)

    def keep_extended(self, extend: np.ndarray) -> np.ndarray:
        """Level-1 nodes plus the children of extended nodes. `extend` must be monotone along
        paths (a path-score threshold is), so checking the parent alone suffices."""
        root = self.parent_row < 0
        return root | (~root & extend[np.maximum(self.parent_row, 0)] & self.valid[np.maximum(self.parent_row, 0)])

    # --- the replay itself ------------------------------------------------------------------
    def run(self, kept: np.ndarray, cost: CostModel, spent: dict | None = None) -> dict:
        """Replayed rates of drafting `kept`. `spent`: what each round paid before verifying
        where the policy knows better than the kept nodes say (grow_replay: forwards fed for a
        level that then drew nothing, decisions about levels not drafted)."""
        n = np.zeros((self.rounds, self.max_depth + 1))
        np.add.at(n, (self.rid[kept], self.depth[kept]), 1)
        n = n[:, 1:]
        levels = (n > 0).sum(1)
        if spent:
            pre = spent["draft_ms"] + spent["consults"] * cost.policy_ms
        else:
            below_last = np.arange(1, self.max_depth + 1)[None] < levels[:, None]
            pre = cost.draft(1) + (cost.draft(n) * below_last).sum(1) + levels * cost.policy_ms
        ms = pre + cost.target(1 + n.sum(1)) + cost.overhead_ms
        acc = np.bincount(self.rid[kept & self.accepted], minlength=self.rounds)
        v = self.visited(acc)
        tokens = v.sum() + acc[v].sum()
        return {"tokens_per_s": float(1000 * tokens / ms[v].sum()), "tokens_per_round": float(tokens / v.sum()),
                "mean_depth": float(levels[v].mean()), "mean_nodes": float(n.sum(1)[v].mean())}


def fixed(d: int, width: int | None = None):
    """Fixed depth d; with `width`, only the first `width` level-1 candidates and their subtrees
    (the same tree drafted narrower: e.g. width 1 of a fork tree is plain `sd`)."""
    if width is None:
        return lambda rs: rs.depth <= d
    return lambda rs: (rs.depth <= d) & (rs.chain < width)


def oracle(rs: ReplaySet) -> np.ndarray:
    """Perfect knowledge, whole levels: draft exactly the levels that will be accepted (>= 1)."""
    return rs.keep_depth(rs.round_accepted.astype(np.int64))


def oracle_tree(rs: ReplaySet) -> np.ndarray:
    """Perfect knowledge, node by node: draft exactly the nodes that will be accepted (any
    sub-tree of the recorded one: a round that accepts nothing drafts nothing)."""
    return rs.accepted.copy()


def confidence_policy(features: np.ndarray, threshold: float):
    """HF assisted generation's rule: stop once no valid node of a level has q >= threshold."""
    q = features[:, Q_TOKEN]
    return lambda rs: rs.keep_depth(rs.first_stop(~rs.level_any(rs.valid & (q >= threshold))))


def confidence_tree_policy(features: np.ndarray, threshold: float):
    """Draft-confidence dynamic tree (EAGLE-2-like): extend a node while its path q >= threshold."""
    path_q = np.exp(features[:, PATH_LOGQ])
    return lambda rs: rs.keep_extended(path_q >= threshold)


def decider_policy(scores: np.ndarray, threshold: float, rule: str):
    """The three decider rules of decoding.decider.policy.DeciderStop, on recorded scores."""
    if rule == "paper":  # continue while some valid node scores above the threshold
        return lambda rs: rs.keep_depth(rs.first_stop(~rs.level_any(rs.valid & (scores > threshold))))
    path = lambda rs: rs.path(scores)
    if rule == "specdecpp":  # stop when P(some drafted token on the best path is rejected) > threshold
        return lambda rs: rs.keep_depth(rs.first_stop(~rs.level_any(rs.valid & (1.0 - path(rs) <= threshold))))
    if rule == "tree":  # extend exactly the nodes whose predicted path acceptance >= threshold
        return lambda rs: rs.keep_extended(path(rs) >= threshold)
    raise ValueError(f"unknown decider rule {rule!r}")


def replay(rs: ReplaySet, policy, cost: CostModel) -> dict:
    """A policy gives the kept mask, or (kept, spent) where it knows what its rounds paid."""
    out = policy(rs)
    return rs.run(out[0], cost, out[1]) if isinstance(out, tuple) else rs.run(out, cost)


def sweep(rs: ReplaySet, make_policy, cost: CostModel, grid) -> tuple[float, dict]:
    """Best threshold of a policy family by replayed tokens/s."""
    results = [(t, replay(rs, make_policy(t), cost)) for t in grid]
    return max(results, key=lambda x: x[1]["tokens_per_s"])


def baseline_table(rs: ReplaySet, features: np.ndarray, cost: CostModel, grid=None) -> dict:
    """Fixed depths, both confidence baselines (best threshold in hindsight), both oracles and
    the best fixed narrower shape of the same tree."""
    grid = np.linspace(0.05, 0.95, 19) if grid is None else grid
    out = {f"fixed-{d}": replay(rs, fixed(d), cost) for d in range(1, rs.max_depth + 1)}
    best_fixed = max(out, key=lambda k: out[k]["tokens_per_s"])
    for name, fam in (("confidence", confidence_policy), ("confidence-tree", confidence_tree_policy)):
        t, res = sweep(rs, lambda t, fam=fam: fam(features, t), cost, grid)
        out[name] = {**res, "threshold": float(t)}
    out["oracle-depth"] = replay(rs, oracle, cost)
    out["oracle"] = replay(rs, oracle_tree, cost)
    out["best_fixed"] = best_fixed
    # the same tree drafted narrower: is any fixed shape better than the best fixed depth?
    shapes = {f"fixed-w{w}-{d}": replay(rs, fixed(d, w), cost)
              for w in range(1, int(rs.chain.max()) + 1) for d in range(1, rs.max_depth + 1)}
    if shapes:
        k = max(shapes, key=lambda k: shapes[k]["tokens_per_s"])
        out["best_fixed_shape"] = {**shapes[k], "shape": k}
    return out


def oracle_share(policy_tps: float, table: dict, oracle_key: str = "oracle") -> float:
    """Fraction of the oracle's gain over the best fixed shape (the best fixed depth where the
    table has no narrower shapes) that a policy captures."""
    base = table.get("best_fixed_shape", table[table["best_fixed"]])["tokens_per_s"]
    gain = table[oracle_key]["tokens_per_s"] - base
    return (policy_tps - base) / gain if gain > 0 else float("nan")


def cost_dict(cost: CostModel) -> dict:
    return asdict(cost)
