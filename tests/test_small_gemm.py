"""The few-row kernel (decoding.small_gemm): exact to its dtype's rounding against a float64
reference on every remainder of its blocking, batch- and thread-invariant, and absent cleanly."""

from __future__ import annotations

import pytest
import torch

from arch_models import tiny
from decoding import small_gemm
from decoding.cache import CachedModel
from decoding.fast_forward import set_forward
from decoding.tree import TreeLayout

needs_kernel = pytest.mark.skipif(not small_gemm.available(), reason=f"no kernel here: {small_gemm.why_not()}")
needs_amx = pytest.mark.skipif(not small_gemm.amx(), reason="no AMX tiles here")


def _case(dtype, t, k, n, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,n", [(1, 64, 8), (2, 577, 37), (3, 31, 5), (4, 96, 4), (5, 1536, 9), (9, 33, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_to_the_dtypes_rounding(dtype, t, k, n, bias):
    """K not a multiple of the vector width, N not of the 4-row block, T over / under the 4-row
    pass: every tail of the loop. Accumulation is fp32, so the error bound is fp32's over K
    terms plus one rounding of the output to `dtype`."""
    x, w, b = _case(dtype, t, k, n, bias)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    y = small_gemm.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (t, n)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    assert ((y.double() - ref).abs() <= mag * 2.0 ** -20 + ref.abs() * out_round).all()


@needs_amx
@pytest.mark.parametrize("t,k,n", [(1, 64, 32), (2, 577, 37), (16, 31, 5), (17, 96, 70), (33, 1536, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_tiles_equal_float64_to_bf16_rounding(t, k, n, bias):
    """AMX: K and N padded to the tiles' 32, rows over one (16) and two (32) tiles of x."""
    x, w, b = _case(torch.bfloat16, t, k, n, bias)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    y = small_gemm.FewRowWeight(w)(x, b)
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    assert ((y.double() - ref).abs() <= mag * 2.0 ** -20 + ref.abs() * 2.0 ** -8).all()


def _rows_alone_and_together(kernel, x, b):
    th = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel(x[i:i + 1].contiguous(), b) for i in range(x.shape[0])]
        torch.set_num_threads(2)
        together = kernel(x, b)
    finally:
        torch.set_num_threads(th)
    return alone, together


@needs_kernel
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 7), (torch.bfloat16, 7), (torch.bfloat16, 33)])
def test_a_row_does_not_depend_on_the_other_rows_or_threads(dtype, rows):
    """Whatever the call carries, row i is the row fed alone, bit for bit, on 1 thread and on 2:
    the row-major kernel (one fp32 chain per output) and, in bf16 where the CPU has them, the AMX
    tiles (a verify of up to 32 rows and a 1-token step agree exactly)."""
    if rows > 7 and not small_gemm.amx():
        pytest.skip("no AMX tiles here")
    x, w, b = _case(dtype, rows, 577, 203, True, seed=1)
    kernels = [lambda x, b: small_gemm.linear(x, w, b)]
    if dtype == torch.bfloat16 and small_gemm.amx():
        kernels.append(small_gemm.FewRowWeight(w))
    for kernel in kernels[-1:] if rows > 7 else kernels:
        alone, together = _rows_alone_and_together(kernel, x, b)
        for i in range(rows):
            assert torch.equal(together[i:i + 1], alone[i])


@needs_kernel
def test_a_lean_step_runs_on_the_kernel_and_agrees_with_onednn():
    """A 1-token lean step goes through the kernel (bf16 and fp32) and gives oneDNN's logits to
    rounding."""
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny("llama").to(dtype)
        logits = {}
        for small in (True, False):
            set_forward(model, "lean", small=small)
            qkv = model.model.layers[0]._lean["qkv"]
            assert qkv.small_below == (small_gemm.rows_below(dtype) if small else 0)
            assert model.lm_head._small_below == qkv.small_below
            cm = CachedModel(model)
            cm.feed(list(range(3, 14)), TreeLayout(()), [], 0, 0)
            with torch.profiler.profile() as prof:
                logits[small] = cm.feed(list(range(3, 15)), TreeLayout(()), [], 0, 0)[0]
            ops = {e.key for e in prof.key_averages()}
            assert bool(ops & {"specstop::small_linear", "specstop::amx_linear"}) == small
        tol = 1e-4 if dtype == torch.float32 else 0.02 * logits[False].abs().max()
        assert (logits[True] - logits[False]).abs().max() <= tol


def test_off_by_environment_or_cpu_or_failed_build(monkeypatch):
    """$SPECSTOP_SMALL_GEMM=0, a CPU without the instructions, a build that fails: not available,
    one phrase why, and rows_below is 0 (linears stay oneDNN's)."""
    monkeypatch.setattr(small_gemm, "_state", {})
    monkeypatch.setenv(small_gemm.ENV, "0")
    assert not small_gemm.available() and small_gemm.why_not() == f"${small_gemm.ENV}=0"
    assert small_gemm.rows_below(torch.bfloat16) == 0
    monkeypatch.delenv(small_gemm.ENV)
    monkeypatch.setattr(small_gemm, "_state", {})
    monkeypatch.setattr(small_gemm, "_cpu_flags", lambda: {"avx2"})
    assert "the CPU lacks avx512f" in small_gemm.why_not()
    monkeypatch.setattr(small_gemm, "_state", {})
    monkeypatch.setattr(small_gemm, "_cpu_flags", lambda: set(small_gemm.FLAGS))
    monkeypatch.setattr(small_gemm, "_registered", lambda: False)

    def fail():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(small_gemm, "_build", fail)
    with pytest.warns(UserWarning, match="linears stay oneDNN's"):
        assert "did not build (RuntimeError: Ninja is required" in small_gemm.why_not()
    assert small_gemm.rows_below(torch.float32) == 0
