"""Where our C++ kernels must exist. decoding.forward.kernels and decoding.forward.quant turn any
build error into a reason and fall back to torch, and the tests that need them skip: without this,
a compile error in csrc/ would leave the suite green. A CPU that cannot run a library, or an
environment that turns it off, may skip; anywhere else a missing library is a failure."""

import os
import platform

import pytest

from decoding.forward import cpu, kernels, quant

QUANT_FLAGS = ("avx2", "fma", "f16c")  # what csrc/quant.h's has_avx2() asks of the CPU
QUANT_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # has_avx512()


def kernels_may_be_missing() -> str | None:
    """Why decoding.forward.kernels may be absent here (None: they must build)."""
    if os.environ.get(kernels.ENV, "").strip() == "0":
        return f"${kernels.ENV}=0"
    missing = [f for f in kernels.FLAGS if f not in cpu.flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def quant_may_be_missing() -> str | None:
    """Why decoding.forward.quant's kernel may be absent here (None: it must build)."""
    if os.environ.get(quant.ENV, "").strip() == "0":
        return f"${quant.ENV}=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernel for {platform.machine()}"
    real = cpu.flags(cpu._cpuinfo())  # the C++ asks the CPU itself, not $SPECSTOP_CPU's view of it
    missing = [f for f in QUANT_FLAGS if f not in real]
    if os.environ.get(quant.ISA_ENV, "").strip() == "avx512":
        missing += [f for f in QUANT_AVX512 if f not in real]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def require_kernels() -> None:
    """Skip where decoding.forward.kernels may be absent; fail where they should have built."""
    if kernels.available():
        return
    why = kernels_may_be_missing()
    if why:
        pytest.skip(f"decoding.forward.kernels: {why}")
    pytest.fail(f"decoding.forward.kernels should build on this CPU: {kernels.why_not()}", pytrace=False)


def require_quant() -> None:
    """Skip where decoding.forward.quant's kernel may be absent; fail where it should have built."""
    if quant.available():
        return
    why = quant_may_be_missing()
    if why:
        pytest.skip(f"decoding.forward.quant: {why}")
    pytest.fail(f"decoding.forward.quant should build on this CPU: {quant.why_not()}", pytrace=False)
