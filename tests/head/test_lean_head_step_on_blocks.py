"""decoding.drafts.lean_step on the quantized library's AVX2 row-wise ops: a head on GGUF-style
blocks steps lean where the AVX512 kernels do not build (as here with them switched off): it
computes what the module step computes (float32 activations: to rounding), several requests' steps
in one equal their own steps bit for bit, and decoding with it stays lossless (greedy = `ar`)."""

from __future__ import annotations

import copy

import pytest
import torch

from decoding.drafts import lean_step
from decoding.drafts.feature import DraftKV
from decoding.forward import kernels, quant
from decoding.forward.packed import set_forward
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

pytestmark = pytest.mark.skipif(not quant.available(), reason=f"quantized kernel: {quant.why_not()}")


@pytest.fixture
def head_on_blocks(feature_pair, monkeypatch):
    """The fitted head on Q8_0 blocks with float32 activations, its lean step on quant's ops."""
    monkeypatch.setenv(quant.ACT_ENV, "f32")
    monkeypatch.setattr(kernels, "batch_invariant", lambda: False)  # as on a CPU without AVX512-BF16
    head = copy.deepcopy(feature_pair[1])
    assert quant.quantize_head(head, "Q8_0") > 0
    set_forward(head, "packed")  # as a GGUF target's head loads: blocks first, then its fast forward
    return feature_pair[0], head


def _calls(head, lens, g):
    H = head.config.hidden_size
    first = [(torch.randint(0, 40, (1, n), generator=g), torch.randn(1, n, H, generator=g), torch.arange(n)[None], None)
             for n in lens]
    level = [(torch.tensor([[5, 6]]), torch.randn(1, 2, H, generator=g), torch.tensor([[n, n]]),
              torch.cat((torch.ones(2, n, dtype=torch.bool), torch.eye(2, dtype=torch.bool)), 1)) for n in lens]
    return first, level


@pytest.mark.parametrize("threads", [1, 2])
def test_the_lean_step_on_avx2_ops_equals_the_module_step_and_batches(head_on_blocks, threads):
    _, head = head_on_blocks
    first, level = _calls(head, [5, 2, 7], torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            solo, many, mods = [DraftKV() for _ in first], [DraftKV() for _ in first], [DraftKV() for _ in first]
            for calls in (first, level):
                want = [lean_step.step(head, t, h, p, c, m) for c, (t, h, p, m) in zip(solo, calls)]
                got = lean_step.steps(head, many, calls)
                ref = [head.step(t, h, p, c, m) for c, (t, h, p, m) in zip(mods, calls)]
                for (lw, hw), (lg, hg), (lr, hr) in zip(want, got, ref):
                    assert torch.equal(lw, lg) and torch.equal(hw, hg)
                    torch.testing.assert_close(lw, lr, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(hw, hr, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    assert head._lean_step is not None and head._lean_step.rows > 32


def test_decoding_with_it_equals_ar(head_on_blocks):
    target, head = head_on_blocks
    greedy = SamplingConfig()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), greedy)
    spec = build_engine(target, head, StrategyConfig(strategy="ti-mcsd", width=3, depth=4), greedy)
    for p in ([1, 5, 7], [2, 8, 9, 9, 4]):
        out, stats = spec.generate(p, 24)
        assert out == ar.generate(p, 24)[0] and stats.accepted > 0
    assert head._lean_step is not None
