"""Trial settings a benchmark measures beside the default (off by default): a shut gate's look at
each new prompt (DraftGate.fresh_share) and a new prompt's head built from its newest rows only
(FeatureCache.catch_up); the text stays ar's."""

import pytest

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


def _round(gate, context: int, tokens: int, ms: float, plain_ms: float = 10.0) -> bool:
    """One steady round at `context`: drafted rounds commit `tokens` in `ms`, plain ones 1 token in
    `plain_ms`, as the engine reports them (record after verify, then timed)."""
    go = gate.drafts(PAYS, context=context)
    if go:
        gate.record(tokens, 3, [2, 1, 1], 3)
    gate.timed(go, ms if go else plain_ms)
    return go


def test_a_prompt_gate_drafts_while_its_own_request_wins():
    """PromptGate: each prompt looks at its first steady round and drafts on while its own rounds
    commit more than a token per plain round's time; a request that drafts badly closes at once
    and looks again after backoff, 2x backoff, ... plain rounds; a new prompt decides anew, whatever
    the one before it drafted."""
    from decoding.stopping.prompt_gate import PromptGate

    gate = PromptGate(backoff=2)
    assert gate.drafts(PAYS, context=100)  # the prompt's round: drafts nothing, is not timed
    good = [_round(gate, 101 + i, tokens=3, ms=15.0) for i in range(10)]
    assert all(good)  # 3 tokens in 15 ms against 10 ms a plain token: it stays open
    gate.drafts(PAYS, context=40)  # a new prompt (the context fell)
    bad = [_round(gate, 41 + i, tokens=1, ms=15.0) for i in range(15)]
    looks = [i for i, go in enumerate(bad) if go]
    assert looks == [0, 3, 8]  # at once, then after 2 and 4 plain rounds (the next after 8)
    assert gate.lookahead() == 8 - (14 - 8)  # plain rounds promised before that look
    gate.drafts(PAYS, context=10)
    assert _round(gate, 11, tokens=1, ms=15.0)  # the next prompt looks at once again
    assert gate.fresh().backoff == 2 and isinstance(gate.fresh(), PromptGate) and not gate.fresh()._mine


def test_a_prompt_gate_opens_again_when_a_look_wins():
    """A closed request whose look commits well drafts on (its latest rounds win again)."""
    from decoding.stopping.prompt_gate import PromptGate

    gate = PromptGate(backoff=2, recent=2)
    gate.drafts(PAYS, context=100)
    assert _round(gate, 101, tokens=1, ms=15.0)  # closes
    assert [_round(gate, 102 + i, tokens=1, ms=15.0) for i in range(2)] == [False, False]
    assert _round(gate, 104, tokens=5, ms=15.0)  # the look: 6 tokens in 30 ms against 10 ms a token
    assert _round(gate, 109, tokens=4, ms=15.0)  # open


def test_a_prompt_gate_weighs_its_rounds_with_earlier_requests():
    """prior: a request's own drafted rounds are weighed with `prior` rounds' worth of earlier
    requests' near this context. After a request that drafted at a loss, a new request's look that
    commits 2 tokens in 1.5 plain rounds' time opens a streak on its own (without a prior) but not
    beside that history; after a request that won, a look that commits 1 token closes the gate on
    its own but not beside that history. A fresh gate keeps the setting, not the history."""
    from decoding.stopping.prompt_gate import PromptGate

    for prior in (0.0, 4.0):
        losing = PromptGate(backoff=2, prior=prior)
        losing.drafts(PAYS, context=100)
        assert sum(_round(losing, 101 + i, tokens=1, ms=15.0) for i in range(12)) == 3  # looks only
        losing.drafts(PAYS, context=40)  # a new prompt
        assert _round(losing, 41, tokens=2, ms=15.0)  # its look at once
        assert _round(losing, 42, tokens=2, ms=15.0) == (prior == 0)

        winning = PromptGate(backoff=2, prior=prior)
        winning.drafts(PAYS, context=100)
        assert all(_round(winning, 101 + i, tokens=3, ms=15.0) for i in range(6))
        winning.drafts(PAYS, context=40)
        assert _round(winning, 41, tokens=1, ms=15.0)
        assert _round(winning, 42, tokens=3, ms=15.0) == (prior > 0)
        assert winning.fresh().prior == prior and not winning.fresh()._theirs
    far = PromptGate(backoff=2, prior=4.0)  # earlier requests far from this context do not count
    far.drafts(PAYS, context=2000)
    [_round(far, 2001 + i, tokens=1, ms=15.0) for i in range(12)]
    far.drafts(PAYS, context=40)
    assert _round(far, 41, tokens=2, ms=15.0) and _round(far, 42, tokens=2, ms=15.0)


@pytest.mark.parametrize("prior", [0.0, 4.0])
def test_a_prompt_gate_keeps_the_text_ars(feature_pair, prior):
    """Greedy with the prompt gate (and the short first catch-up it is measured with; with earlier
    requests' rounds weighed in, `prior`) is ar's text."""
    from decoding.stopping.prompt_gate import PromptGate

    target, draft = feature_pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                         max_nodes=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    eng = build_engine(target, draft, cfg, SamplingConfig(),
                       stop=GrowPolicy(q_scores, PAYS, max_width=2, max_nodes=8, gate=PromptGate(backoff=2, prior=prior)))
    eng.proposer.model.catch_up = 4
    for p in (prompt, prompt[:6]):
        got, st = eng.generate(p, N)
        assert got == ar_output(target, p, N) and st.rounds > 0


@pytest.mark.parametrize("prior", [0.0, 4.0])
def test_sampling_stays_exact_with_a_prompt_gate(tiny_pair, prior):
    """Whether a round drafts follows what the request's earlier rounds committed (a round of 1 token
    closes it, one of 2 or more keeps it open; with `prior`, earlier requests' too): the sampled
    continuations keep the target's law."""
    from support.exact import SAMPLES, T1, chi2_pvalue, exact_distribution, speculative_counts
    from decoding.stopping.prompt_gate import PromptGate

    class Timed(PromptGate):  # a drafted round takes 1.5 plain rounds, whatever the machine
        def timed(self, drafted, ms, behind_ms=0.0):
            super().timed(drafted, 15.0 if drafted else 10.0)

    target, draft = tiny_pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence", confidence_rule="grow",
                         max_nodes=4)
    gate = Timed(backoff=1, prior=prior)
    eng = build_engine(target, draft, cfg, T1, stop=GrowPolicy(q_scores, PAYS, max_width=2, max_nodes=4, gate=gate))
    counts, depths, _ = speculative_counts(eng, SAMPLES)
    assert depths[0] > 0.05 * SAMPLES and sum(v for d, v in depths.items() if d >= 1) > 0.05 * SAMPLES
    pvalue = chi2_pvalue(counts, exact_distribution(target, T1), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


def test_the_gate_option_picks_the_grow_rules_gate():
    """--gate: request (the default) or context; another name is one clear error before any load."""
    from decoding.options import StrategyConfig as Config
    from decoding.stopping.prompt_gate import PromptGate, make_gate

    assert Config("ti-mcsd").gate == "request" and type(make_gate("request")) is PromptGate
    assert type(make_gate("context")) is DraftGate
    grow = dict(stop="confidence", confidence_rule="grow")
    assert "gate-context" in Config("ti-mcsd", gate="context", **grow).name
    assert "gate" not in Config("ti-mcsd", **grow).name and "gate" not in Config("sd", gate="context").name
    with pytest.raises(ValueError, match="unknown gate 'often'"):
        Config("ti-mcsd", gate="often")
