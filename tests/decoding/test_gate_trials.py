"""Trial settings a benchmark measures beside the default (off by default): a shut gate's look at
each new prompt (DraftGate.fresh_share) and a new prompt's head built from its newest rows only
(FeatureCache.catch_up); the text stays ar's."""

from support.head import ar_output
from decoding.forward.cost import CostCurve
from decoding.growth import GrowPolicy, q_scores
from decoding.sampling import SamplingConfig
from decoding.stopping.gate import DraftGate
from decoding.strategies import StrategyConfig, build_engine

PAYS = CostCurve([1, 16, 64], [10.0, 10.5, 12.0], [0.5, 0.5, 0.6], overhead_ms=0.2, policy_ms=0.1)
"""Rows and steps cheap beside a plain step: a confident draft pays."""
N = 30


def test_a_shut_gate_may_look_at_a_new_prompt():
    """fresh_share: a shut gate whose looks come 32 rounds apart looks at a new prompt's first
    round after the prompt's own (fresh_burst rounds in a row) once look_share / fresh_share of
    that spacing has passed, and promises no plain rounds at the prompt's round, so its features
    are kept for the head; off (the default), the new prompt runs plain."""
    for share, looks in ((0.0, False), (0.05, True)):
        gate = DraftGate(warmup=1, explore_every=4, look_share=0.005, fresh_share=share, fresh_burst=2)
        gate.record(1, 64, [2] + [64] * 10, 640)  # far behind: shut, the rate gap's look every 32nd round
        assert not any(gate.drafts(PAYS, context=100 + i) for i in range(10))  # one request's plain rounds
        assert not gate.drafts(PAYS, context=60)  # a new prompt (the context fell): its round verifies it
        assert (gate.lookahead() == 0) == looks
        assert [gate.drafts(PAYS, context=61 + i) for i in range(3)] == [looks, looks, False]
    short = DraftGate(warmup=1, explore_every=4, look_share=0.005, fresh_share=0.05)
    short.record(1, 64, [2] + [64] * 10, 640)
    short.drafts(PAYS, context=100)
    assert not short.drafts(PAYS, context=60) and not short.drafts(PAYS, context=61)  # 1 plain round: too soon


def test_an_empty_head_cache_catches_up_on_its_newest_rows_only(feature_pair, monkeypatch):
    """FeatureCache.catch_up: a new prompt's first catch-up builds the newest `catch_up` entries
    (the whole prompt without it); the head drafts from them and the text stays ar's."""
    from decoding.drafts import feature_proposer as fp

    target, draft = feature_pair
    built = []
    real = fp.head_step
    monkeypatch.setattr(fp, "head_step", lambda d, c, tokens, *a: built.append((tokens.shape[1], a[-1])) or
                        real(d, c, tokens, *a))
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                         max_nodes=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for cap in (None, 3):
        built.clear()
        eng = build_engine(target, draft, cfg, SamplingConfig(),
                           stop=GrowPolicy(q_scores, PAYS, max_width=2, max_nodes=8, gate=DraftGate.held_open()))
        eng.proposer.model.catch_up = cap
        got, st = eng.generate(prompt, N)
        assert got == ar_output(target, prompt, N) and st.accepted > 0
        first = next(n for n, last in built if last is True)  # the first catch-up (only its last logits read)
        assert first == (len(prompt) if cap is None else cap)  # entries up to the first generated token
