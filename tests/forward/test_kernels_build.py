"""Both C++ libraries build wherever the CPU can run them. The tests that use them skip when they
are missing, so these two are what make a compile error in csrc/ fail the suite (the reason names
the compiler's first error)."""

import pytest
import torch

from decoding.forward import kernels, quant
from support.kernels import kernels_may_be_missing, quant_may_be_missing


def test_cpu_kernels_build_where_the_cpu_has_avx512_bf16():
    why = kernels_may_be_missing()
    if why:
        pytest.skip(f"decoding.forward.kernels may be absent: {why}")
    assert kernels.why_not() is None, kernels.why_not()
    assert kernels.rows_below(torch.float32) > 0  # and the forwards use them


def test_quantized_kernel_builds_on_any_x86_with_avx2():
    why = quant_may_be_missing()
    if why:
        pytest.skip(f"decoding.forward.quant may be absent: {why}")
    assert quant.why_not() is None, quant.why_not()
    assert quant.isa() in ("avx2", "avx512")

