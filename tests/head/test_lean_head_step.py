"""decoding.drafts.lean_step: the feature head's step on the CPU kernels computes what the module
step computes (float32, to rounding; the same draft cache), is what runs once the head has a fast
forward, and leaves decoding lossless: greedy equal to `ar` in float32 and, with AMX, in bf16 bit
for bit; sampling exact over an enumerated vocabulary."""

from __future__ import annotations

import copy

import pytest
import torch

from support.head import CASES, GREEDY, N, PROMPTS, SAMPLES
from support.exact import chi2_pvalue, exact_distribution, speculative_counts
from decoding.forward import kernels
from decoding.drafts import lean_step
from decoding.drafts.feature import DraftKV
from decoding.forward.packed import set_forward
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

pytestmark = pytest.mark.skipif(not kernels.batch_invariant(), reason=f"kernels: {kernels.describe()}")


def fast(models, dtype=torch.float32):
    """Copies in `dtype` on the lean (target) / packed (head) forward."""
    out = tuple(copy.deepcopy(m).to(dtype) for m in models)
    for m in out:
        set_forward(m, "lean")
    return out


def test_lean_step_equals_the_module_step(feature_pair):
    """Catch-up (causal, no mask) then a tree level (a bool mask over cache + level) against the
    module step on the same head and an equal cache: logits and h to fp32 rounding, and the cache
    holds the same keys and values."""
    target, draft = feature_pair
    head = fast((draft,))[0]
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(1, 5, draft.config.hidden_size, generator=g)
    toks, pos = torch.tensor([[1, 4, 2, 7, 3]]), torch.arange(5)[None]
    tree_toks, tree_pos = torch.tensor([[5, 6, 8]]), torch.tensor([[5, 5, 6]])
    mask = torch.cat((torch.ones(3, 5, dtype=torch.bool), torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]]).bool()), 1)
    got, want = DraftKV(), DraftKV()
    with torch.inference_mode():
        outs = [lean_step.step(head, toks, hid, pos, got), head.step(toks, hid, pos, want)]
        h = outs[1][1][:, -3:]
        outs += [lean_step.step(head, tree_toks, h, tree_pos, got, mask), head.step(tree_toks, h, tree_pos, want, mask)]
    assert head._lean_step is not None
    for (lg, hl), (lw, hw) in (outs[:2], outs[2:]):
        torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hl, hw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.k, want.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.v, want.v, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # an eager head keeps the modules (the reference)
        set_forward(head, "eager")
        assert torch.equal(lean_step.step(head, toks, hid, pos)[0], head.step(toks, hid, pos)[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_several_requests_in_one_step_equal_their_own_steps(feature_pair, threads):
    """decoding.batch's joint drafting: three requests' catch-ups (different lengths, causal), then
    their tree levels (masks) in ONE lean step each time: every request's logits, h and draft
    cache are those of its own step, bit for bit (row-invariant kernels)."""
    head = fast((feature_pair[1],))[0]
    g = torch.Generator().manual_seed(1)
    H = head.config.hidden_size
    lens = [5, 2, 7]
    first = [(torch.randint(0, 40, (1, n), generator=g), torch.randn(1, n, H, generator=g), torch.arange(n)[None], None)
             for n in lens]
    level = [(torch.tensor([[5, 6]]), torch.randn(1, 2, H, generator=g), torch.tensor([[n, n]]),
              torch.cat((torch.ones(2, n, dtype=torch.bool), torch.eye(2, dtype=torch.bool)), 1)) for n in lens]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            solo, many = [DraftKV() for _ in lens], [DraftKV() for _ in lens]
            for calls in (first, level):
                want = [lean_step.step(head, t, h, p, c, m) for c, (t, h, p, m) in zip(solo, calls)]
                got = lean_step.steps(head, many, calls)
                for (lw, hw), (lg, hg), c1, c2 in zip(want, got, solo, many):
                    assert torch.equal(lw, lg) and torch.equal(hw, hg)
                    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    finally:
        torch.set_num_threads(before)


def test_a_catch_up_computes_only_its_last_row_s_logits(feature_pair):
    """last=True (a catch-up: only the anchor's logits are read) gives the last row's logits of the
    whole step, bit for bit, alone and beside other requests' full levels; h and the cache as ever."""
    head = fast((feature_pair[1],))[0]
    g = torch.Generator().manual_seed(2)
    H = head.config.hidden_size
    calls = [(torch.randint(0, 40, (1, n), generator=g), torch.randn(1, n, H, generator=g), torch.arange(n)[None], None)
             for n in (6, 3, 5)]
    with torch.inference_mode():
        full = [lean_step.step(head, *c[:3], DraftKV(), None) for c in calls]
        for i, (t, hid, pos, m) in enumerate(calls):
            lg, h = lean_step.step(head, t, hid, pos, DraftKV(), m, last=True)
            assert lg.shape[1] == 1 and torch.equal(lg[0, 0], full[i][0][0, -1]) and torch.equal(h, full[i][1])
        got = lean_step.steps(head, [DraftKV() for _ in calls], [c + (i != 1,) for i, c in enumerate(calls)])
    for i, ((lg, h), (lw, hw)) in enumerate(zip(got, full)):
        assert torch.equal(lg, lw[:, -1:] if i != 1 else lw) and torch.equal(h, hw)


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.name)
def test_greedy_with_the_lean_head_equals_ar(feature_pair, cfg):
    target, draft = fast(feature_pair)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    eng = build_engine(target, draft, cfg, GREEDY)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == ar.generate(prompt, N)[0]
    assert draft._lean_step is not None


@pytest.mark.skipif(not kernels.amx(), reason="bf16 batch invariance needs AMX linears")
def test_bf16_greedy_with_the_lean_head_equals_bf16_ar_bit_for_bit(feature_pair):
    target, draft = fast(feature_pair, torch.bfloat16)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for cfg in CASES:
        eng = build_engine(target, draft, cfg, GREEDY)
        for prompt in PROMPTS:
            assert eng.generate(prompt, N)[0] == ar.generate(prompt, N)[0], cfg.name


def test_sampling_with_the_lean_head_is_exact(tiny_pair):
    target, draft = fast(tiny_pair)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence", confidence_threshold=0.3)
    counts, depths, _ = speculative_counts(build_engine(target, draft, cfg, sampling), SAMPLES)
    assert draft._lean_step is not None
    assert sum(v for d, v in depths.items() if d >= 1) > 0.3 * SAMPLES
    assert chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES) > 1e-3


def test_the_lean_step_lives_as_long_as_the_fast_forward(feature_pair):
    """Like packed weights, the fused copies belong to one set_forward: switching the forward drops
    them, and the next fast forward (here after a dtype change) builds them anew."""
    _, draft = feature_pair
    head = fast((draft,))[0]
    toks, hid, pos = torch.tensor([[1, 4]]), torch.randn(1, 2, draft.config.hidden_size), torch.arange(2)[None]
    with torch.inference_mode():
        lean_step.step(head, toks, hid, pos)
        assert head._lean_step is not None
        set_forward(head, "eager")
        assert "_lean_step" not in head.__dict__
        head.to(torch.bfloat16)
        set_forward(head, "lean")
        hid = hid.to(torch.bfloat16)
        got = lean_step.step(head, toks, hid, pos)[0]
        want = head.step(toks, hid, pos)[0]
    assert head._lean_step is not None and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()
