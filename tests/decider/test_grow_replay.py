"""The grow rule replayed on traces (training.decider.grow_replay): closed-form cases on
hand-drawn rounds, and the replayed tree equal to the one the engine grows from the same state."""

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from support.models import noisy_copy, tiny_llama
from support.decider import FORK, table
from decoding.forward.cost import CostCurve
from decoding.stopping.gate import DraftGate
from decoding.growth import GrowPolicy, q_scores
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from training.decider.grow_replay import grow_kept, grow_policy
from training.decider.replay import CostModel, ReplaySet, replay

FLAT = CostModel(sizes=[1, 64], target_ms=[10.0, 10.0], draft_ms=[0.0, 0.0], overhead_ms=0.0, unit="tokens")


def test_a_free_tree_keeps_every_node_worth_something():
    # verification and drafting cost the same whatever the tree: every node with value > 0 pays.
    # Chain 1 (nodes 1, 3, 5) is scored 0: never drafted; chain 0 wholly.
    rs = ReplaySet(table([(FORK, {0, 2})]))
    scores = np.array([0.9, 0.0, 0.8, 0.5, 0.7, 0.5])
    assert grow_kept(rs, scores, FLAT).tolist() == [True, False, True, False, True, False]
    # the chain envelope keeps branch 0 only, whatever the scores
    assert grow_kept(rs, np.full(6, 0.9), FLAT, level_widths=(1, 1, 1)).tolist() == [True, False, True, False, True, False]
    assert grow_kept(rs, np.full(6, 0.9), FLAT, max_nodes=3).sum() == 3


def test_a_round_pays_the_forward_of_a_level_it_then_leaves_empty():
    """The grow rule feeds a level before sizing it: where the fed level then draws nothing,
    the forward was paid all the same (and every level's parents cost the policy's ms each)."""
    chain = (-1, 0, 1)
    rs = ReplaySet(table([(chain, {0})]))
    cost = CostModel(sizes=[1, 64], target_ms=[10.0, 10.0], draft_ms=[1.0, 1.0], overhead_ms=0.0, unit="tokens")
    scores = np.array([0.9, 0.0, 0.0])  # level 1 looks worth a deeper level; level 2 is worth nothing
    spent = {}
    kept = grow_kept(rs, scores, cost, spent=spent)
    assert kept.tolist() == [True, False, False]
    # the round's first forward, then the one that fed node 0 for level 2; the host work of two
    # parents (the anchor on level 1, node 0 on level 2)
    assert spent["draft_ms"].tolist() == [2.0] and spent["consults"].tolist() == [2]
    paid = replace(cost, policy_ms=0.5)
    r = replay(rs, grow_policy(scores, cost), paid)
    assert r["tokens_per_s"] == pytest.approx(1000 * 2 / (2.0 + 2 * 0.5 + 10.0))
    # counted from the kept nodes alone, the empty level's forward and decisions were free
    assert rs.run(kept, paid)["tokens_per_s"] == pytest.approx(1000 * 2 / (1.0 + 0.5 + 10.0))


def test_sampled_levels_are_sized_by_the_candidates_then_valued_by_the_draws():
    # the engine sizes a level from its top-k candidates' scores (count_scores), then draws and
    # values what it drew (scores): both roots are drawn; root 0's draw is worth nothing, so
    # only root 1's chain goes deeper
    rs = ReplaySet(table([(FORK, {1, 3})]))
    drawn = np.array([0.0, 0.9, 0.9, 0.9, 0.9, 0.9])
    kept = grow_kept(rs, drawn, FLAT, count_scores=np.full(6, 0.9))
    assert kept.tolist() == [True, True, False, True, False, True]
    assert not grow_kept(rs, np.full(6, 0.9), FLAT, count_scores=np.zeros(6)).any()


def test_steep_cost_takes_one_node_then_stops():
    # rate with no tree 1 / 10 ms; node 0 (0.6) gives 1.6 / 12; adding node 1 (0.3 after the
    # sibling cap) 1.9 / 20: the level takes one. The next level (0.6 x 0.5 = 0.3 more for
    # 8 ms) does not pay either: one node in all.
    steep = CostModel(sizes=[1, 2, 3, 4], target_ms=[10.0, 12.0, 20.0, 40.0], draft_ms=[0.0] * 4, unit="tokens")
    rs = ReplaySet(table([(FORK, {0})]))
    kept = grow_kept(rs, np.array([0.6, 0.3, 0.5, 0.5, 0.5, 0.5]), steep)
    assert kept.tolist() == [True, False, False, False, False, False]
    res = replay(rs, grow_policy(np.array([0.6, 0.3, 0.5, 0.5, 0.5, 0.5]), steep), steep)
    assert res["mean_nodes"] == 1 and res["tokens_per_round"] == 2


def test_nothing_pays_nothing_is_drafted():
    rs = ReplaySet(table([(FORK, set())]))
    assert not grow_kept(rs, np.full(6, 0.01), CostModel(sizes=[1, 2], target_ms=[10.0, 30.0],
                                                          draft_ms=[1.0, 1.0], unit="tokens")).any()


# verification a little dearer per token, drafting cheap: trees of many shapes on a tiny pair
GENTLE = CostCurve([1, 3, 6, 12], [10.0, 10.5, 11.5, 14.0], [0.5] * 4)


def _path(tree_parents, tokens, i):
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = tree_parents[i]
    return tuple(reversed(out))


@pytest.mark.parametrize("k_config", [(3, 1, 1, 1), (1, 1, 1, 1, 1)])
def test_replay_grows_the_tree_the_engine_grows(k_config):
    """Record the full tree of each prompt's first round, replay grow on it, and grow in the
    engine from the same state (strategy mcsd with that tree as its envelope): same nodes."""
    from training.decider.traces import SCHEMA, TraceRecorder

    target = tiny_llama(0, scale=40)
    draft = noisy_copy(target, 0.02)
    greedy = SamplingConfig()
    k = ",".join(map(str, k_config))
    full = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config=k), greedy)
    rec = TraceRecorder(greedy)
    full.observer = rec
    cfg = StrategyConfig(strategy="mcsd", k_config=k, stop="confidence", confidence_rule="grow")
    pol = GrowPolicy(q_scores, GENTLE, max_width=max(k_config), level_widths=k_config, max_nodes=16,
                     gate=DraftGate.held_open())  # every first round drafts: the trees are compared
    grown = build_engine(target, draft, cfg, greedy, stop=pol)
    engine_trees, shapes = [], set()
    grown.observer = lambda tree, *_: engine_trees.append(tree)
    prompts = [[1 + i, 3 * i % 29 + 2, 5] for i in range(12)]
    for i, prompt in enumerate(prompts):
        rec.start(f"p{i}")
        full.generate(prompt, 8)  # the whole tree, recorded: round 0 starts from the prompt
        engine_trees.clear()
        grown.generate(prompt, 8)
        t = engine_trees[0]
        want = {_path(t.layout.parents, t.tokens, j) for j in range(t.size)}
        rows = rec.take()
        rows = {c: [v for v, r in zip(col, rows["round"]) if r == 0] for c, col in rows.items()}
        tab = pa.table(rows, schema=SCHEMA)
        rs = ReplaySet(tab)
        q = np.array([f[11] for f in rows["features"]])  # q_token
        kept = grow_kept(rs, q, GENTLE, max_nodes=16, level_widths=k_config)
        by_node = {n: j for j, n in enumerate(rows["node"])}
        got = {_path([by_node.get(rows["parent"][j], -1) for j in range(len(kept))], rows["token"], j)
               for j in np.flatnonzero(kept)}
        assert got == want, (prompt, got, want)
        shapes.add(t.layout.depths)
    assert len(shapes) >= 3, shapes  # the rule really sized the trees differently
