"""decoding.bench.compiled_forward: the torch.compile probe computes what the engine's forward does."""

import pytest
import torch

from support.models import tiny_llama
from decoding.bench.compiled_forward import CompiledForward
from decoding.bench.forward import _Forward


@pytest.mark.slow
def test_compiled_probe_matches_the_engine_forward_at_every_size():
    model = tiny_llama(0, vocab=64, layers=2, hidden=32)
    ref, probe = _Forward(model, 64, 12), CompiledForward(model, 64, 12, max_new=3)
    for n in (1, 3, 1, 3):  # sizes recompile once each; a size seen again reuses its graph
        want = ref.call(n, ref.prepare(n))
        got = probe.call(n)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (n, (got - want).abs().max())
    assert sorted(probe.compile_s) == [1, 3]
