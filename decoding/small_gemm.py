"""Few-row linears that stream the weight once: the kernel of a decode step on a CPU.

A decoding step multiplies 1-2 rows by every weight matrix, so its cost is reading the weights.
oneDNN's prepacked kernels read a layer's small matrices (0.7-3.5 MB) at ~9-10 GB/s on one core
of a 2-core AMX Xeon; `csrc/small_gemm.cpp` (AVX512-BF16 / AVX512F dot products over the
row-major weight, prefetching 16 KiB ahead across page boundaries the hardware prefetcher stops
at) reads them at the core's streaming rate: all the linears of a 1-token bf16 step of
SmolLM2-135M in 0.76x oneDNN's time. Its dot products run out of arithmetic above a few rows,
where oneDNN's AMX kernels win, so it serves row counts below `ROWS_BELOW` only (measured
crossovers: reports/forward-2026-11-27-small-gemm).

A row's result does not depend on the other rows of the call or the thread count (one fp32
chain per vector lane), but it is rounded differently from oneDNN's: in bf16 a 1-token step and
the same row inside a larger verify agree to rounding, not bit for bit.

Built on first use with torch's C++ extension loader (~8 s once per machine, cached under
$TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default); only where the CPU has the
instructions, a compiler is found and $SPECSTOP_SMALL_GEMM is not 0. Otherwise `available()` is
False, `why_not()` says why, and the linears stay oneDNN's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

ENV = "SPECSTOP_SMALL_GEMM"
"""0 turns the kernel off (the linears stay oneDNN's)."""
ROWS_BELOW = {torch.bfloat16: 4, torch.float32: 7}
"""Row counts below which the kernel runs; above, oneDNN's (AMX) kernels are faster. Whole
1-thread forwards of SmolLM2-135M on a 2-core AMX Xeon, kernel / oneDNN: bf16 0.88x, 0.86x,
0.93x at 1, 2, 3 rows, 1.00x at 4; fp32 0.92x-0.84x at 1-4 rows, 0.97x at 6, 1.01x at 8
(reports/forward-2026-11-27-small-gemm)."""
FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
SOURCE = Path(__file__).parent / "csrc" / "small_gemm.cpp"
_state: dict = {}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return set()


def _load() -> str | None:
    """Build / load the op once per process; None when it is ready, else why not."""
    if os.environ.get(ENV, "").strip() == "0":
        return f"${ENV}=0"
    missing = [f for f in FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if _registered():
        return None
    try:
        _build()
    except Exception as e:  # no compiler, no ninja, a read-only cache: the oneDNN path still works
        why = f"the kernel did not build ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        warnings.warn(f"decoding.small_gemm: {why}; linears stay oneDNN's", stacklevel=3)
        return why
    return None


def _registered() -> bool:
    return hasattr(torch.ops.specstop, "small_linear")


def _build() -> None:
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
    load("specstop_small_gemm", [str(SOURCE)], extra_cflags=flags, is_python_module=False)


def why_not() -> str | None:
    """None when the kernel is usable in this process, else one phrase why not."""
    if "why" not in _state:
        _state["why"] = _load()
    return _state["why"]


def available() -> bool:
    return why_not() is None


def rows_below(dtype: torch.dtype) -> int:
    """Row counts below which a linear in `dtype` runs on the kernel here (0: never)."""
    return ROWS_BELOW.get(dtype, 0) if available() else 0


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w[N, K].T + bias, both contiguous, one dtype (bfloat16 / float32) -> [T, N]."""
    return torch.ops.specstop.small_linear(x, w, bias)
