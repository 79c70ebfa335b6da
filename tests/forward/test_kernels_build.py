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



def test_libraries_build_from_copies_named_by_their_sources(tmp_path, monkeypatch):
    """torch's loader writes the sources' paths into its build file: building from the checkout
    rebuilt a library for every checkout path. The copies live under the library's own name, which
    carries the sources' hash, so every checkout of the same sources builds from the same paths."""
    from decoding.forward import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = f"specstop_cpu_kernels_{kernels.source_digest(kernels.SOURCES)}"
    paths = kernels.stable_sources(name, kernels.SOURCES)
    assert [p.rsplit("/", 1)[1] for p in paths] == [p.name for p in kernels.SOURCES]
    copy = tmp_path / "specstop-src" / name
    assert all(str(copy) in p for p in paths)
    assert all((copy / h.name).read_bytes() == h.read_bytes() for h in kernels.CSRC.glob("*.h"))
    stamp = [(copy / p.name).stat().st_mtime_ns for p in kernels.SOURCES]
    assert kernels.stable_sources(name, kernels.SOURCES) == paths  # the second checkout's call
    assert [(copy / p.name).stat().st_mtime_ns for p in kernels.SOURCES] == stamp
