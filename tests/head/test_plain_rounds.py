"""Plain rounds beside drafted ones with a feature head (the server's measured choice,
decoding.batch.measured): a round without a tree still hands the head the target's features of
what it committed (proposer.plain()), so the head drafts right after it and the text is ar's."""

from support.head import N, PROMPTS, ar_output
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.batch.measured import MeasuredChoice
from decoding.forward.cost import CostCurve
from decoding.growth import q_scores
from decoding.tree import layout_from_k_config

FLAT = CostCurve([1, 64], [10.0, 10.5], [0.1, 0.1])  # rows nearly free: the budget drafts


def test_a_head_drafts_after_plain_rounds_and_the_text_is_ars(feature_pair):
    target, draft = feature_pair
    measured = MeasuredChoice(warmup=10 ** 9)  # never warm: drafted and plain rounds take turns
    eng = BatchEngine(target, draft, layout_from_k_config((2, 2, 2)),
                      budget=JointGrow(q_scores, FLAT, max_width=2), measured=measured)
    reqs = [eng.add(p, N) for p in PROMPTS]
    while eng.active:
        eng.step()
    for p, r in zip(PROMPTS, reqs):
        assert r.out == ar_output(target, p)
    assert measured.timed.get((len(PROMPTS), True), 0) >= 2 and measured.timed.get((len(PROMPTS), False), 0) >= 2
    assert sum(r.stats.accepted for r in reqs) > 0  # drafted (and right) between plain rounds
