"""The device round (decoding.round) on the CPU: greedy equality with `ar` for every tree shape,
the same accepted lengths as the host engine with the same head, exact sampling with the device's
own draws, the whole round traced by torch.compile(fullgraph=True) with no graph break, and no op
outside the round call but its one host read."""

import pytest

from support.exact import SAMPLES, T1, WARPED, chi2_pvalue, exact_distribution, speculative_counts
from support.head import GREEDY, N, PROMPTS, ar_output
from decoding.round import accept
from decoding.round.engine import RoundEngine
from decoding.round.shape import RoundShape
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

SHAPES = {"ar": (), "sd": (1, 1, 1), "mcsd": (3, 2, 1), "fork": (2, 1, 1, 1)}
HOST = {"sd": StrategyConfig("sd", gamma=3), "mcsd": StrategyConfig("mcsd", k_config="3,2,1"),
        "fork": StrategyConfig("ti-mcsd", width=2, depth=4)}


@pytest.mark.parametrize("name", SHAPES)
def test_greedy_equals_ar_and_drafts_as_the_host_round(feature_pair, name):
    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape(SHAPES[name]), GREEDY, name)
    host = build_engine(target, head, HOST[name], GREEDY) if name in HOST else None
    accepted = 0
    for prompt in PROMPTS:
        out, st = eng.generate(prompt, N)
        assert out == ar_output(target, prompt)
        assert st.new_tokens == N and st.lossless
        accepted += st.accepted
        if host is not None:  # the same head, the same tree: the same rounds
            assert st.accepted_lengths == host.generate(prompt, N)[1].accepted_lengths
    assert name == "ar" or accepted > 0, "no draft token accepted: the commit went untested"


def test_built_from_the_options_and_refused_where_it_cannot_run(feature_pair):
    target, head = feature_pair
    eng = build_engine(target, head, StrategyConfig("sd", gamma=2, round="device"), GREEDY)
    assert isinstance(eng, RoundEngine) and eng.name == "sd[g=2]+device"
    assert eng.generate(PROMPTS[0], N)[0] == ar_output(target, PROMPTS[0])
    with pytest.raises(ValueError, match="fixed tree"):
        StrategyConfig("ti-mcsd", stop="confidence", round="device")
    with pytest.raises(ValueError, match="feature head"):
        build_engine(target, target, StrategyConfig("sd", round="device"), GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([], 4)


def test_eos_ends_the_text_inside_a_round(feature_pair):
    target, head = feature_pair
    ref = ar_output(target, PROMPTS[2])
    eos = ref[5]
    out, _ = RoundEngine(target, head, RoundShape((1, 1, 1)), GREEDY).generate(PROMPTS[2], N, eos_token_id=eos)
    assert out == ref[:ref.index(eos) + 1]


def test_cache_growth_keeps_the_text(feature_pair, monkeypatch):
    from decoding.round import runner

    monkeypatch.setattr(runner, "START_CAPACITY", 16)
    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape((2, 1)), GREEDY)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == ar_output(target, prompt)
    assert eng.runner.sc.capacity > 16


@pytest.mark.parametrize("ks,sampling", [((2, 2), T1), ((2, 1), WARPED), ((), T1)], ids=["tree", "top-p", "ar"])
def test_sampling_is_exact(tiny_pair, ks, sampling):
    target, head = tiny_pair
    counts, _, sizes = speculative_counts(RoundEngine(target, head, RoundShape(ks), sampling), SAMPLES)
    assert not ks or sizes[RoundShape(ks).rows - 1] > 0
    pvalue = chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


def test_sampling_test_catches_a_broken_residual(tiny_pair, monkeypatch):
    monkeypatch.setattr(accept, "residual", lambda p, q: p)
    target, head = tiny_pair
    counts, _, _ = speculative_counts(RoundEngine(target, head, RoundShape((2, 2)), T1), SAMPLES)
    assert chi2_pvalue(counts, exact_distribution(target, T1), SAMPLES) < 1e-6


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, top_p=0.9)], ids=["greedy", "top-p"])
def test_the_round_traces_whole_with_no_graph_break(feature_pair, sampling):
    """fullgraph=True raises on any graph break: the round has no host sync and no Python that
    depends on device data."""
    import torch._dynamo

    torch._dynamo.reset()
    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), sampling)
    eng.step = torch.compile(eng.runner.round, fullgraph=True, backend="eager", dynamic=False)
    out, st = eng.generate(PROMPTS[0], N)
    assert len(out) == N and st.rounds > 1
    if sampling.greedy:
        assert out == ar_output(target, PROMPTS[0])


def test_no_op_outside_the_round_and_one_host_read(feature_pair):
    from decoding.bench.launches import per_round

    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), GREEDY)
    eng.generate(PROMPTS[0], 4)
    r = per_round(eng, PROMPTS, N)
    assert r["rounds"] > len(PROMPTS)
    outside = {p: n for p, n in r["by_phase"].items() if p != "prefill"}
    assert sum(outside.values()) == 0, outside
    assert r["host_reads_per_round"] <= 1.0


def test_the_round_splits_into_its_steps(feature_pair):
    from decoding.round.timing import split_ms

    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), GREEDY)
    ms = split_ms(eng, PROMPTS[0], reps=3)
    assert set(ms) == {"draft_ms", "verify_ms", "accept_commit_ms", "round_ms"} and ms["round_ms"] > 0
    assert eng.generate(PROMPTS[0], N)[0] == ar_output(target, PROMPTS[0])  # the timing left no trace


@pytest.mark.parametrize("lookahead", [2, 3])
def test_rounds_queued_ahead_of_the_read_keep_the_text(feature_pair, lookahead):
    """Round r + 1 launched before round r is read (as on CUDA): the same text, EOS and the token
    budget honoured, the rounds launched past them dropped."""
    target, head = feature_pair
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), GREEDY, lookahead=lookahead)
    for prompt in PROMPTS:
        ref = ar_output(target, prompt)
        assert eng.generate(prompt, N)[0] == ref
        assert eng.generate(prompt, 7)[0] == ref[:7]
        eos = ref[9]
        assert eng.generate(prompt, N, eos_token_id=eos)[0] == ref[:ref.index(eos) + 1]
