"""decoding.forward.packed: prepacked linears change how a model computes, not what it is."""

import pytest
import torch

from support.models import tiny_llama
from decoding.forward import packed as ff
from decoding.kv_cache import CachedModel
from decoding.models.fingerprint import fingerprint
from decoding.tree import layout_from_k_config

pytestmark = pytest.mark.skipif(not ff.packed_available(torch.float32, "cpu"), reason="no oneDNN on this CPU")


def feed_logits(model, n=5):
    m = CachedModel(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    lay = layout_from_k_config([n - 1])
    m.feed(prompt[:-1], lay, [], 0, 0)
    return m.feed(prompt, lay, [(7 + i) % 32 for i in range(n - 1)], 0, n - 1)[0]


def test_packed_keeps_the_parameters_and_the_logits():
    model = tiny_llama(0, vocab=32, layers=2)
    fp, ref = fingerprint(model), feed_logits(model)
    names = [n for n, _ in model.named_parameters()]
    assert ff.set_forward(model, "packed") == "packed" == ff.forward_kind(model)
    assert ff.pack_linears(model) == 0 and ff.forward_kind(model) == "packed"  # nothing twice
    assert [n for n, _ in model.named_parameters()] == names and fingerprint(model) == fp
    got = feed_logits(model)
    assert torch.allclose(got, ref, atol=1e-4) and torch.equal(got.argmax(-1), ref.argmax(-1))
    assert ff.set_forward(model, "eager") == "eager"
    assert torch.equal(feed_logits(model), ref)  # the reference path, restored exactly


def test_a_packed_row_does_not_depend_on_how_many_rows_a_forward_carries_beyond_rounding():
    lin = torch.nn.Linear(64, 96)
    ff.pack_linears(lin)
    x = torch.randn(16, 64)
    with torch.inference_mode():
        full = lin(x)
        # bit-identical rows hold on the AVX512 CPU this was written on; oneDNN may pick another
        # kernel for few rows on other CPUs, so across machines only rounding is promised
        assert all(torch.allclose(lin(x[:k]), full[:k], atol=1e-5, rtol=1e-5) for k in (1, 2, 5, 8))
        assert lin(x[None]).shape == (1, 16, 96)  # any leading dims
        half = torch.nn.Linear(64, 96).to(torch.bfloat16)
        ref = half(x.bfloat16())
        if ff.pack_linears(half):  # bf16 packs where the CPU has bf16 support
            assert torch.allclose(half(x.bfloat16()).float(), ref.float(), atol=0.05)


def test_few_rows_take_the_small_kernel_or_the_default_one_and_more_rows_the_packed_one(monkeypatch):
    """Rows below kernels.ROWS_BELOW run on the few-row kernel where it is built; without it
    (kernels=False, or a CPU without them) float32 keeps the default kernel below 4 rows, bit for bit;
    more rows take oneDNN's packed kernel."""
    from decoding.forward import kernels

    x = torch.randn(80, 64)  # more rows than any few-row kernel takes
    calls = {"packed": 0, "small": 0}
    real_packed = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.__setitem__("packed", calls["packed"] + 1) or real_packed(*a))
    real_small = kernels.FewRowWeight.__call__
    monkeypatch.setattr(kernels.FewRowWeight, "__call__",
                        lambda *a: calls.__setitem__("small", calls["small"] + 1) or real_small(*a))
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 96)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        ff.pack_linears(lin, kernels=False)
        one = torch.nn.functional.linear(x[2:3], lin.weight, lin.bias)
        assert torch.equal(lin(x[2:3]), one) and torch.equal(lin(x[None, 2:3]), one[None])
        assert torch.equal(lin(x[:2]), torch.nn.functional.linear(x[:2], lin.weight, lin.bias))
        assert calls == {"packed": 0, "small": 0}  # 1-3 rows, float32: the eager kernel, bit for bit
        assert torch.allclose(lin(x[:4]), want[:4], atol=1e-5) and calls["packed"] == 1
        if not kernels.available():
            return
        lin2 = torch.nn.Linear(64, 96)
        ff.pack_linears(lin2)
        below = kernels.rows_below(torch.float32)
        assert torch.allclose(lin2(x[:below - 1]), torch.nn.functional.linear(x[:below - 1], lin2.weight, lin2.bias),
                              atol=1e-5)
        assert calls == {"packed": 1, "small": 1}
        lin2(x[:below])
        assert calls == {"packed": 2, "small": 1}
        b = torch.nn.Linear(64, 96).to(torch.bfloat16)
        ff.pack_linears(b)
        for rows, (packed, small) in ((1, (2, 2)), (kernels.rows_below(torch.bfloat16), (3, 2))):
            b(x[:rows].to(torch.bfloat16))
            assert (calls["packed"], calls["small"]) == (packed, small)


def test_the_default_forward_and_its_override(monkeypatch):
    monkeypatch.delenv(ff.ENV, raising=False)
    assert ff.default_forward(torch.float32, "cpu") == "lean"
    assert ff.default_forward(torch.float16, "cpu") == "eager"  # no packed fp16 linear here
    assert ff.default_forward(torch.float32, "cuda") == "graph"  # measured: reports/gpu-2026-11-27
    monkeypatch.setenv(ff.ENV, "eager")
    assert ff.default_forward(torch.float32, "cpu") == "eager"
    monkeypatch.setenv(ff.ENV, "packed")
    assert ff.default_forward(torch.float32, "cpu") == "packed"
    monkeypatch.setenv(ff.ENV, "fast")
    with pytest.raises(ValueError, match="SPECSTOP_FORWARD must be one of eager, packed"):
        ff.default_forward(torch.float32, "cpu")
    with pytest.raises(ValueError, match="forward must be one of"):
        ff.set_forward(torch.nn.Linear(2, 2), "fast")
