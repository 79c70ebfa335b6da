"""A decoder layer in one kernel call (`specstop::decoder_layer`) and the packed weights in 2 MiB
pages (`kernels.gather`): both change where time goes, never a result. The lean forward's
logits and KV cache are the per-op layer's bit for bit, over prefill, tree rounds, commits and a
sliding window; the gathered weights are the packed ones, laid out in the order a forward reads
them."""

from __future__ import annotations

import pytest
import torch

from support.forward import layer_rounds
from support.models import tiny
from decoding.forward import kernels
from decoding.kv_cache import CachedModel
from decoding.forward.packed import few_row_weights, set_forward

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"no kernel here: {kernels.why_not()}")
ONE_CALL = ["llama", "qwen2", "qwen2+window", "mistral+window"]  # qwen3's per-head q/k norms keep the per-op layer


def _dtypes():
    """fp32 (panels) everywhere the kernels build; bf16 where its linears are AMX tiles."""
    return [torch.float32] + ([torch.bfloat16] if kernels.amx() else [])


def _lean(arch, dtype, one_call=True):
    model = tiny(arch).to(dtype)
    set_forward(model, "lean")
    if not one_call:
        for layer in model.model.layers:
            layer._lean["one_call"] = 0
    return model


@needs_kernel
@pytest.mark.parametrize("arch", ONE_CALL)
@pytest.mark.parametrize("dtype", _dtypes())
def test_one_call_layers_equal_the_per_op_layers_bit_for_bit(arch, dtype, monkeypatch):
    model = _lean(arch, dtype)
    assert all(layer._lean["one_call"] > 1 for layer in model.model.layers)
    per_op = _lean(arch, dtype, one_call=False)  # the same seeded weights
    cls = type(CachedModel(model).cache.layers[0])  # the growing layer, sliding ones too
    calls = []
    grown = cls.grown
    monkeypatch.setattr(cls, "grown", lambda self, *a: (calls.append(1), grown(self, *a))[1])
    got, got_keys = layer_rounds(model)
    n = len(calls)
    ref, ref_keys = layer_rounds(per_op)
    # every forward after the prefill (a windowed prefill has a mask: it runs in one call too); none per op
    assert n >= 3 * len(model.model.layers) and len(calls) == n
    for a, b in zip(got + got_keys, ref + ref_keys):
        assert torch.equal(a, b)


@needs_kernel
def test_qk_norm_layers_keep_the_per_op_layer():
    model = _lean("qwen3", torch.float32)
    assert not any(layer._lean["one_call"] for layer in model.model.layers)


@needs_kernel
@pytest.mark.parametrize("dtype", _dtypes())
def test_gathered_weights_are_the_packed_ones_in_reading_order(dtype, monkeypatch):
    model = _lean("llama", dtype)
    weights = few_row_weights(model)
    assert len(weights) == 4 * len(model.model.layers) + 1  # the layers' fused linears, then lm_head
    assert all(w.in_arena for w in weights)
    ptrs = [w.w.data_ptr() for w in weights]
    assert len({w.w.untyped_storage().data_ptr() for w in weights}) == 1  # one arena
    assert ptrs[0] % (2 << 20) == 0 and ptrs == sorted(ptrs)
    assert all(b - a == w.w.nbytes for a, b, w in zip(ptrs, ptrs[1:], weights))
    monkeypatch.setattr(kernels, "gather", lambda ws: 0)  # as packed, each in its own allocation
    plain = _lean("llama", dtype)
    assert not any(getattr(w, "in_arena", False) for w in few_row_weights(plain))
    for a, b in zip(weights, few_row_weights(plain)):
        assert torch.equal(a.w, b.w)
    (got, got_keys), (ref, ref_keys) = layer_rounds(model), layer_rounds(plain)
    for a, b in zip(got + got_keys, ref + ref_keys):
        assert torch.equal(a, b)


@needs_kernel
def test_huge_empty_is_aligned_and_sized():
    t = torch.ops.specstop.huge_empty(1000, torch.bfloat16)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and t.data_ptr() % (2 << 20) == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1500.0
    assert torch.ops.specstop.huge_empty(0, torch.float32).numel() == 0


@needs_kernel
def test_huge_pages_off_by_environment(monkeypatch):
    monkeypatch.setenv(kernels.PAGES_ENV, "0")
    model = _lean("llama", torch.float32)
    assert not any(getattr(w, "in_arena", False) for w in few_row_weights(model))
