"""Trace replay on hand-drawn rounds: fixed shapes, oracles and the dynamic-tree rules."""

import numpy as np
import pyarrow as pa
import pytest

from support.decider import FORK, table
from training.decider.replay import (
    CostModel,
    ReplaySet,
    baseline_table,
    calibrate,
    decider_policy,
    fixed,
    monotone,
    oracle,
    oracle_tree,
    replay,
)

# constant costs: a round is draft 1 ms per call + target 10 ms, whatever the sizes
COST = CostModel(sizes=[1, 64], target_ms=[10.0, 10.0], draft_ms=[1.0, 1.0], overhead_ms=0.0)


def test_fixed_depth_and_oracles_closed_form():
    rs = ReplaySet(table([(FORK, {0, 2, 4}), (FORK, set())]))
    r3 = replay(rs, fixed(3), COST)  # both rounds draft 3 levels and verify 6 nodes
    assert r3["tokens_per_round"] == (4 + 1) / 2
    assert r3["tokens_per_s"] == pytest.approx(1000 * 5 / (2 * (3 + 10)))
    assert replay(rs, fixed(3), COST)["mean_nodes"] == 6
    o = replay(rs, oracle, COST)  # depth 3 then depth 1
    assert o["tokens_per_s"] == pytest.approx(1000 * 5 / ((3 + 10) + (1 + 10)))
    ot = replay(rs, oracle_tree, COST)  # exactly the accepted nodes: the chain of 3, then none
    assert ot["mean_nodes"] == (3 + 0) / 2 and ot["tokens_per_round"] == 2.5
    assert ot["tokens_per_s"] == pytest.approx(1000 * 5 / ((3 + 10) + (1 + 10)))
    narrow = replay(rs, fixed(2, width=1), COST)  # chain 0 only, 2 deep
    assert narrow["mean_nodes"] == 2 and narrow["tokens_per_round"] == (3 + 1) / 2


def test_tree_rule_extends_only_confident_paths():
    rs = ReplaySet(table([(FORK, {1, 3})]))
    # chain 1 scores 0.9 per node, chain 0 0.2: path products 0.9, 0.81, 0.73 vs 0.2, 0.04
    scores = np.array([0.2, 0.9, 0.2, 0.9, 0.2, 0.9])
    kept = decider_policy(scores, 0.5, "tree")(rs)
    assert kept.tolist() == [True, True, False, True, False, True]
    res = replay(rs, decider_policy(scores, 0.5, "tree"), COST)
    assert res["tokens_per_round"] == 3 and res["mean_nodes"] == 4
    # the same scores with the whole-level rules keep whole levels
    assert replay(rs, decider_policy(scores, 0.5, "paper"), COST)["mean_nodes"] == 6
    assert decider_policy(scores, 0.95, "specdecpp")(rs).sum() == 6  # 1 - 0.73 <= 0.95: never stops
    assert decider_policy(scores, 0.05, "specdecpp")(rs).sum() == 2   # 1 - 0.9 > 0.05: stops at 1


def test_baseline_table_bounds():
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(40):
        n = rng.integers(0, 4)  # accepted prefix of chain 0 or chain 1
        chain = rng.integers(0, 2)
        rounds.append((FORK, {chain + 2 * i for i in range(n)}))
    rs = ReplaySet(table(rounds))
    feats = np.zeros((len(rs.depth), 17), np.float32)
    tab = baseline_table(rs, feats, COST)
    best = max(tab[f"fixed-{d}"]["tokens_per_s"] for d in (1, 2, 3))
    assert tab[tab["best_fixed"]]["tokens_per_s"] == best
    assert tab["oracle"]["tokens_per_s"] >= tab["oracle-depth"]["tokens_per_s"] >= best
    assert tab["best_fixed_shape"]["shape"].startswith("fixed-w1-")


def test_measured_costs_are_made_monotone_in_the_tree_size():
    # a noise burst inflated size 4 (161 ms, measured here); size 2 read below size 1
    ms = [62.5, 48.3, 161.5, 69.0, 59.3, 77.7, 110.8]
    assert monotone(ms) == [48.3, 48.3, 59.3, 59.3, 59.3, 77.7, 110.8]
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # already monotone: unchanged


def test_calibrate_measures_forwards_and_bookkeeping_on_a_tiny_pair(pair, tmp_path):
    import json
    import time
    from dataclasses import asdict

    from training.decider.threshold import ReplayConfig, load_cost

    target, draft = pair
    # every target forward sleeps 100 ms: it must show in target_ms and NOT in the bookkeeping,
    # which is the round's time outside the forwards (a tiny pair's bookkeeping and draft step
    # take a few ms, far below 100 even on a loaded machine)
    hook = target.register_forward_pre_hook(lambda m, a: time.sleep(0.1))
    try:
        cm = calibrate(target, draft, context=32, repeats=3, sizes=[1, 4, 16],
                       collect={"strategy": "ti-mcsd", "width": 2, "depth": 3}, overhead_tokens=6)
    finally:
        hook.remove()
    assert cm.sizes == [1, 4, 16] and len(cm.target_ms) == len(cm.draft_ms) == 3
    for ms in (cm.target_ms, cm.draft_ms):
        assert all(m > 0 for m in ms) and ms == sorted(ms)  # positive, monotone medians
    assert min(cm.target_ms) >= 100 > max(cm.draft_ms)
    assert 0 < cm.overhead_ms < 100
    assert set(cm.source) == {"target_ms", "draft_ms", "overhead_ms", "policy_ms"}
    assert "measured" in cm.source["overhead_ms"] and "W=2,D=3" in cm.source["overhead_ms"]
    # saved as the fit stores it, read back by replay.cost_model: the same model, provenance kept
    p = tmp_path / "cost.json"
    p.write_text(json.dumps(asdict(cm)))
    assert load_cost(ReplayConfig(cost_model=str(p)), {}) == cm


def test_a_round_at_every_position_is_walked_as_deployment_runs_it():
    """Chains of 3 at positions 0..5 of one prompt: a policy's next round starts after what its
    round commits (accepted + 1), so each policy is scored on its own rounds."""
    chain = (-1, 0, 1)
    accepted = [{0, 1}, set(), set(), {0}, {0, 1, 2}, set()]  # per position
    t = table([(chain, a) for a in accepted])
    # positions from 1: a feature draft's first round reads the prompt only (no tree, no row)
    t = t.append_column("position", pa.array([r + 1 for r, a in enumerate(accepted) for _ in chain], pa.int32()))
    rs = ReplaySet(t)
    assert rs.walks
    # depth 3: positions 0 (2 accepted) -> 3 (1) -> 5 (0) -> past the text
    r3 = replay(rs, fixed(3), COST)
    assert r3["tokens_per_round"] == (3 + 2 + 1) / 3
    assert r3["tokens_per_s"] == pytest.approx(1000 * 6 / (3 * (3 + 10)))
    # depth 1: 0 (1) -> 2 (0) -> 3 (1) -> 5 (0)
    r1 = replay(rs, fixed(1), COST)
    assert r1["tokens_per_round"] == 6 / 4 and r1["tokens_per_s"] == pytest.approx(1000 * 6 / (4 * 11))
    # the oracle walks too: 0 (2) -> 3 (1) -> 5 (0, nothing drafted)
    assert replay(rs, oracle_tree, COST)["mean_nodes"] == pytest.approx((2 + 1 + 0) / 3)
    # without a round at every position (here: no position 2), every recorded round counts
    gap = table([(chain, a) for a in accepted[:2] + accepted[3:]])
    gap = gap.append_column("position", pa.array([r for r in (0, 1, 3, 4, 5) for _ in chain], pa.int32()))
    assert not ReplaySet(gap).walks
    assert replay(ReplaySet(gap), fixed(3), COST)["tokens_per_round"] == (5 + 2 + 0 + 1 + 3 + 0) / 5
