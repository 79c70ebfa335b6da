"""decoding.batch.drafting: a feature head drafts every request's level in ONE step, the first
level's nodes too, and the trees are the ones each request's own steps draft."""

import copy

import pytest
import torch

from decoding.batch import drafting
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.drafts.lean_step import shares_steps
from decoding.drafts.feature_proposer import FeatureCache
from decoding.forward import kernels
from decoding.forward.cost import CostCurve
from decoding.forward.packed import set_forward
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.tree import ANCHOR, layout_from_k_config

pytestmark = pytest.mark.skipif(not kernels.batch_invariant(), reason=f"kernels: {kernels.describe()}")

LAYOUT = layout_from_k_config(fork_k_config(3, 4))
CHEAP = CostCurve([1, 8, 16, 64], [10.0, 10.5, 11.0, 20.0], [0.1, 0.1, 0.1, 0.2])
"""Rows and draft steps nearly free: deep trees, so the first level's nodes get fed."""
PROMPTS = [[1, 5, 7], [2, 8], [9, 9, 4, 4, 11, 30, 17]]


@pytest.fixture(scope="module")
def lean_head_pair():
    from support.head import fit_head
    from support.models import tiny_llama

    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(target)
    target, head = copy.deepcopy(target), copy.deepcopy(head)
    assert set_forward(target, "lean") == "lean"
    assert set_forward(head, "lean") == "packed" and shares_steps(head)  # a head: packed, its steps lean
    return target, head


def _trees(pair, monkeypatch, one_by_one: bool):
    """Each request's tree every round and its output, under the joint budget (score above q:
    trees of several levels); one_by_one: every level through each request's own feed."""
    score = lambda level: 0.5 + 0.5 * q_scores(level)  # noqa: E731
    eng = BatchEngine(*pair, LAYOUT, budget=JointGrow(score, CHEAP, max_width=3))
    trees: list = []
    propose = eng._propose
    eng._propose = lambda reqs: [trees.append((r.id, t.layout.parents, tuple(t.tokens))) or t
                                 for r, t in zip(reqs, propose(reqs))]
    reqs = [eng.add(p, 16) for p in PROMPTS]
    with monkeypatch.context() as m:
        if one_by_one:
            m.setattr(drafting.Drafting, "plan", lambda self: None)
        eng.run()
    return trees, [r.out for r in reqs]


def test_first_level_nodes_step_with_other_requests_and_draft_the_same_trees(lean_head_pair, monkeypatch):
    firsts = []
    plan = FeatureCache.plan

    def counted(self, committed, layout, tokens, start, end):
        firsts.append(start == 0 and end > 0)
        return plan(self, committed, layout, tokens, start, end)
    monkeypatch.setattr(FeatureCache, "plan", counted)
    with torch.inference_mode():
        together, out = _trees(lean_head_pair, monkeypatch, one_by_one=False)
        alone, out_alone = _trees(lean_head_pair, monkeypatch, one_by_one=True)
    assert sum(firsts) > 0  # the first level's nodes were planned into the shared step
    assert together == alone and out == out_alone
    assert any(p != ANCHOR for _, parents, _ in together for p in parents)  # trees of more than one level
