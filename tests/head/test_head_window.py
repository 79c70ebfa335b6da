"""A feature head attending a window of the newest committed positions (head_window): lossless
(greedy equality with `ar`, exact sampling), its cache holds only the window's entries, each the
entry a whole-context build makes at that position, and the batched engine honours it too."""

import pytest
import torch

from support.exact import chi2_pvalue, exact_distribution, speculative_counts
from support.head import CASES, GREEDY, N, SAMPLES, ar_output
from decoding.batch.scheduler import BatchEngine
from decoding.drafts.capture import capture_aux
from decoding.drafts.feature import DraftKV
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config

LONG = [(3 * i + 1) % 37 + 1 for i in range(30)]
"""A prompt longer than the windows tested: the first drafted round's catch-up skips."""
WINDOW = 6


def windowed(cfg: StrategyConfig, window: int = WINDOW) -> StrategyConfig:
    return StrategyConfig(**{**cfg.__dict__, "head_window": window})


@pytest.mark.parametrize("cfg", CASES[:3], ids=lambda c: c.name)
def test_greedy_equals_ar_with_a_window(feature_pair, cfg):
    target, draft = feature_pair
    eng = build_engine(target, draft, windowed(cfg), GREEDY)
    accepted = 0
    for prompt in ([1, 2, 3], LONG):
        out, stats = eng.generate(prompt, N)
        assert out == ar_output(target, prompt)
        accepted += stats.accepted
    assert accepted > 0, "no draft token accepted: the windowed bookkeeping went untested"


def test_the_cache_holds_the_window_s_true_entries(feature_pair):
    """After a long prompt and a run, the head's cache holds at most 1.5x the window's entries,
    and each equals the entry a whole-context build makes at its absolute position (a single
    layer's keys and values depend on the entry's own input and position only)."""
    target, draft = feature_pair
    eng = build_engine(target, draft, windowed(StrategyConfig(strategy="mcsd", k_config="2,2,1")), GREEDY)
    out, stats = eng.generate(LONG, N)
    assert stats.accepted > 0
    fc = eng.proposer.model
    n, kept = fc.length, fc.entries
    assert kept == len(fc.cache) and WINDOW <= kept <= WINDOW + WINDOW // 2 and n > 2 * kept
    seq = LONG + out
    with torch.no_grad(), capture_aux(target, draft.config.aux_layers) as cap:
        target(input_ids=torch.tensor([seq]))
    ref = DraftKV()
    with torch.no_grad():
        draft.step(torch.tensor([seq[1: n + 1]]), draft.fuse(cap.aux()[:, :n]), torch.arange(n)[None], ref)
    torch.testing.assert_close(fc.cache.k, ref.k[:, :, n - kept:n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fc.cache.v, ref.v[:, :, n - kept:n], rtol=1e-4, atol=1e-5)


def test_a_window_changes_what_the_head_drafts(feature_pair):
    """The window is not a no-op: on a long prompt, a window of 2 drafts other trees than the
    whole context (the test above would pass on a head that ignored it only if nothing was cut)."""
    target, draft = feature_pair
    cfg = StrategyConfig(strategy="mcsd", k_config="3,2,1")
    drafted = []
    for window in (0, 2):
        eng = build_engine(target, draft, windowed(cfg, window), GREEDY)
        drafted.append([])
        eng.observer = lambda tree, logits, outcome, pos, seen=drafted[-1]: seen.append(tuple(tree.tokens))
        eng.generate(LONG, N)
    assert drafted[0] != drafted[1]


def test_sampling_is_exact_with_a_window(tiny_pair):
    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0)
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2", head_window=1), sampling)
    counts, depths, _ = speculative_counts(eng, SAMPLES)
    assert sum(v for d, v in depths.items() if d >= 1) > 0.3 * SAMPLES
    pvalue = chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


def test_the_batched_engine_honours_the_window(feature_pair):
    target, draft = feature_pair
    engine = BatchEngine(target, draft, layout_from_k_config((2, 2, 1)), head_window=WINDOW)
    reqs = [engine.add(p, N) for p in (LONG, [1, 2, 3], LONG[5:])]
    engine.run()
    for r, p in zip(reqs, (LONG, [1, 2, 3], LONG[5:])):
        assert r.out == ar_output(target, p)
    assert all(r.stats.accepted for r in reqs)


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="head_window must be >= 0"):
        StrategyConfig(strategy="sd", head_window=-1)
