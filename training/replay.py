"""Replay recorded traces under a cost model: what tokens/s would a stop policy have given?

Each collected round drafted the full tree. Stopping after depth d keeps the BFS-prefix
tree of depth d; acceptance decisions at depth <= d do not depend on deeper nodes (greedy,
and sampling with the same uniforms), so that round would have committed
min(accepted, d) + 1 tokens at cost draft(d) + verify(tree(d)) + overhead. Rounds are
treated independently (as SpecDec++'s analysis does).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from decoding.features import FEATURE_NAMES

Q_TOKEN = FEATURE_NAMES.index("q_token")


@dataclass
class CostModel:
    """Milliseconds per forward as a function of the number of new tokens fed (interpolated)."""

    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    target_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    overhead_ms: float = 0.5
    """Bookkeeping per round (acceptance walk, cache commit)."""
    policy_ms: float = 0.0
    """Stop-policy cost per drafted level (decider inference)."""

    def target(self, n: int) -> float:
        return float(np.interp(n, self.sizes, self.target_ms))

    def draft(self, n: int) -> float:
        return float(np.interp(n, self.sizes, self.draft_ms))

    def round_ms(self, level_sizes: list[int], d: int, pending: int = 1) -> float:
        """Round that drafted levels 1..d: d draft calls (pending tokens, then levels 1..d-1)
        and one target call over pending + all drafted nodes."""
        fed = [pending] + level_sizes[: d - 1]
        return (sum(self.draft(n) for n in fed[:d]) + self.target(pending + sum(level_sizes[:d]))
                + self.overhead_ms + d * self.policy_ms)


@torch.inference_mode()
def calibrate(target, draft, context: int = 256, repeats: int = 5, sizes=None) -> CostModel:
    """Measure forward times on this machine for each tree size (median of `repeats`)."""
    from decoding.cache import CachedModel
    from decoding.tree import layout_from_k_config

    cm = CostModel(**({"sizes": sizes} if sizes else {}))
    vocab = target.get_output_embeddings().weight.shape[0]
    prompt = [(10 + i) % vocab for i in range(context)]
    for model, out in ((target, cm.target_ms), (draft, cm.draft_ms)):
        m = CachedModel(model)
        for n in cm.sizes:
            lay = layout_from_k_config([n])  # n siblings: the mask/positions path of a real tree
            times = []
            for _ in range(repeats + 1):
                m.reset()
                m.feed(prompt[:-1], lay, [], 0, 0)
                t = time.perf_counter()
                m.feed(prompt, lay, [(1 + i) % vocab for i in range(n)], 0, n)
                times.append(1000 * (time.perf_counter() - t))
            out.append(float(np.median(times[1:])))
    return cm


@dataclass
class Round:
    level_sizes: list[int]
    accepted: int
    levels: list[np.ndarray]
    """Row indices of each level's nodes into the trace table."""


def rounds_of(table) -> list[Round]:
    cols = {c: table.column(c).to_numpy(zero_copy_only=False)
            for c in ("prompt_id", "round", "depth", "round_accepted", "valid")}
    key = np.char.add(cols["prompt_id"].astype(str), np.char.add(":", cols["round"].astype(str)))
    order = np.lexsort((cols["depth"], key))
    out, start = [], 0
    k = key[order]
    bounds = np.flatnonzero(k[1:] != k[:-1]) + 1
    for group in np.split(order, bounds):
        depths = cols["depth"][group]
        levels = [group[depths == d] for d in range(1, depths.max() + 1)]
        out.append(Round([len(x) for x in levels], int(cols["round_accepted"][group[0]]), levels))
    return out


def replay(rounds: list[Round], stop_depth, cost: CostModel) -> dict:
    """stop_depth(round) -> depth at which the policy stops. Returns tokens/s and friends."""
    tokens = ms = drafted = 0
    for r in rounds:
        d = max(1, min(stop_depth(r), len(r.level_sizes)))
        tokens += min(r.accepted, d) + 1
        ms += cost.round_ms(r.level_sizes, d)
        drafted += d
    return {"tokens_per_s": 1000 * tokens / ms, "tokens_per_round": tokens / len(rounds),
            "mean_depth": drafted / len(rounds)}


def fixed(d):
    return lambda r: d


def oracle(r: Round) -> int:
    """Perfect knowledge: draft exactly the levels that will be accepted (at least one)."""
    return r.accepted


def first_stop(stop_at_level):
    """Dynamic policy: the first depth whose level makes `stop_at_level(rows)` true."""
    def depth(r: Round) -> int:
        for d, rows in enumerate(r.levels, 1):
            if stop_at_level(rows):
                return d
        return len(r.levels)
    return depth


def confidence_policy(features: np.ndarray, valid: np.ndarray, threshold: float):
    q = features[:, Q_TOKEN]
    return first_stop(lambda rows: not (valid[rows] & (q[rows] >= threshold)).any())


def decider_policy(scores: np.ndarray, valid: np.ndarray, parents: np.ndarray, nodes: np.ndarray,
                   threshold: float, rule: str):
    """The two decider rules of decoding.decider.DeciderStop, on recorded scores."""
    if rule == "paper":
        return first_stop(lambda rows: not (valid[rows] & (scores[rows] > threshold)).any())

    def depth(r: Round) -> int:
        path: dict[int, float] = {}
        for d, rows in enumerate(r.levels, 1):
            best = 0.0
            for i in rows:
                v = path.get(int(parents[i]), 1.0) * float(scores[i])
                path[int(nodes[i])] = v
                if valid[i]:
                    best = max(best, v)
            if 1.0 - best > threshold:
                return d
        return len(r.levels)
    return depth


def sweep(rounds, make_policy, cost: CostModel, grid) -> tuple[float, dict]:
    """Best threshold of a policy family by replayed tokens/s."""
    results = [(t, replay(rounds, make_policy(t), cost)) for t in grid]
    return max(results, key=lambda x: x[1]["tokens_per_s"])


def baseline_table(rounds, features, valid, cost: CostModel) -> dict:
    """Fixed depths, the confidence baseline (best threshold) and the oracle bound."""
    max_d = max(len(r.level_sizes) for r in rounds)
    out = {f"fixed-{d}": replay(rounds, fixed(d), cost) for d in range(1, max_d + 1)}
    best_fixed = max((k for k in out), key=lambda k: out[k]["tokens_per_s"])
    t, res = sweep(rounds, lambda t: confidence_policy(features, valid, t), cost, np.linspace(0.05, 0.95, 19))
    out["confidence"] = {**res, "threshold": float(t)}
    out["oracle"] = replay(rounds, oracle, cost)
    out["best_fixed"] = best_fixed
    return out


def oracle_share(policy_tps: float, table: dict) -> float:
    """Fraction of the oracle's gain over the best fixed depth that a policy captures."""
    base = table[table["best_fixed"]]["tokens_per_s"]
    gain = table["oracle"]["tokens_per_s"] - base
    return (policy_tps - base) / gain if gain > 0 else float("nan")


def cost_dict(cost: CostModel) -> dict:
    return asdict(cost)
