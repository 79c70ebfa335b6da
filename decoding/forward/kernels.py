"""The CPU kernels of a decode step: few-row linears that stream the weight once, and one-pass
row-wise ops (RMSNorm, the rotary embedding, the SiLU gate) for the lean layers.

A decoding step multiplies 1-32 rows (one token, or a verified tree) by every weight matrix, so
its cost is reading the weights. oneDNN's prepacked kernels read a layer's small matrices
(0.7-3.5 MB) at ~9-10 GB/s on one core of a 2-core AMX Xeon, because the hardware prefetcher
stops at every 4 KiB page. `csrc/gemm.cpp` prefetches 16 KiB ahead itself:
- `amx_linear` (bf16 on CPUs with AMX): tiles over a weight packed once into their layout; the
  linears of a 30-layer step cost 0.74x oneDNN's at 1 row and 0.77-0.89x at 2-32 rows, so one
  kernel serves a plain step and every verify up to `AMX_ROWS`;
- `panel_linear` (fp32): FMAs over a weight packed once into panels of 48 outputs, one chain per
  output, up to 8 rows in one pass over the weight; the 121 linears of a step cost ~0.75x oneDNN's
  at 1 row and ~0.8-0.9x at 8-32 rows;
- `small_linear` (bf16 with AVX512-BF16 but no AMX): dot products over the row-major weight, out
  of arithmetic above a few rows (`ROWS_BELOW`).
Above those sizes (a prefill, a very large tree) oneDNN's kernels run. `csrc/layer_ops.cpp`:
torch runs a CPU rms_norm as ~10 ops (~11 us a row; this one pass, ~2 us), the rotary embedding as
~5; each becomes one loop with fp32 math and one rounding per output. `csrc/attention.cpp`: the
attention of a step or a verify (scores on AMX tiles, rows as vector lanes), cheaper than torch's
and batch-invariant (INVARIANT_ENV).

`csrc/layer.cpp`: a whole lean decoder layer in one call over these kernels. `csrc/arena.cpp`:
`gather` puts a model's packed weights in one allocation of 2 MiB pages, in the order a forward
reads them (a TLB miss every 4 KiB cost the stream ~15% on one core of an AMX Xeon).

The linears are batch-invariant: a row's result does not depend on the other rows of the call or
the thread count, so a 1-token step and the same row inside a verify agree bit for bit (bf16 on
AMX up to AMX_ROWS, fp32 on the panels up to PANEL_ROWS); where a row count switches kernels
they agree to rounding.

Built on first use by torch's C++ extension loader (~14 s once per machine on 2 cores, cached under
$TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default), only where the CPU has AVX512-BF16,
a compiler is found and $SPECSTOP_CPU_KERNELS is not 0; otherwise `why_not()` says why and the
lean forward keeps torch's ops and oneDNN's linears.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import os
import warnings
from pathlib import Path

import torch

from decoding.forward import cpu

ENV = "SPECSTOP_CPU_KERNELS"
"""0 turns the kernels off (the lean forward keeps torch's ops and oneDNN's linears)."""
PAGES_ENV = "SPECSTOP_HUGE_PAGES"
"""0: packed weights stay in their own allocations (4 KiB pages) instead of one 2 MiB-page arena
(`gather`): ~0.05-0.5 s less at load, each forward ~3-6% dearer on one thread (2-core AMX Xeon)."""
ROWS_BELOW = {torch.bfloat16: 4}
"""Row counts below which `small_linear` runs (bf16 without AMX); above, oneDNN's kernels are
faster. Whole 1-thread forwards of SmolLM2-135M on a 2-core AMX Xeon, kernel / oneDNN: bf16 0.88x,
0.86x, 0.93x at 1, 2, 3 rows, 1.00x at 4 (reports/forward-2026-11-26-kernel-crossovers; fp32 was
0.92x-0.84x at 1-4 rows, 1.01x at 8, before `panel_linear` replaced it)."""
INVARIANT_ENV = "SPECSTOP_BATCH_INVARIANT"
"""0: the lean layers attend with torch's scaled_dot_product_attention instead of `row_attention`.
By default steps and verifies attend with `row_attention` (up to `attention_rows`), whose rows
depend only on their visible keys, so with AMX linears a bf16 verify's rows equal 1-token steps bit
for bit and bf16 speculation reproduces bf16 `ar` exactly. It is also the cheaper kernel: a bf16
forward (1 thread, AMX Xeon, 200 cached tokens, the same weights) costs 0.90-0.98x torch's
attention's at 1-32 tokens (reports/forward-2026-11-27-row-attention/same_weights_ab.md)."""
AMX_ROWS = 65
"""Most rows `amx_linear` (and, in bf16 with AMX, `row_attention`) take: a grown tree's 64 nodes
and the pending token, so every verify of the default trees is batch-invariant. A step's linears
cost 0.82-0.89x oneDNN's at 32 rows (reports/forward-2026-11-26-kernel-crossovers); whole bf16
forwards of 33-65 tokens on one loaded target, against oneDNN + torch's attention: 0.94-1.07x on
1 thread, 0.85-0.98x on 2 (reports/forward-2026-11-27-row-attention/rows-33-65.md)."""
PANEL_ROWS = 32
"""Most rows `panel_linear` (fp32) takes: ~0.8-0.95x oneDNN's at 8-32 rows
(reports/forward-2026-11-27-panels-48); above, oneDNN's blocked GEMM."""
FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(p for p in CSRC.glob("*.cpp") if not p.name.startswith("quant"))
"""Every csrc/*.cpp but the quantized library's (decoding.forward.quant builds `quant*.cpp`)."""
ops = torch.ops.specstop
"""The kernels' ops: callers reach them here, after `available()` built and loaded them."""
_state: dict = {}


def _registered() -> bool:
    return hasattr(ops, "small_linear")


def _build() -> None:
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
    # the name carries a hash of every source and header: torch's loader rebuilds on a changed
    # source but not on a changed header
    name = f"specstop_cpu_kernels_{source_digest(SOURCES)}"
    load(name, stable_sources(name, SOURCES), extra_cflags=flags + ["-fopenmp"], extra_ldflags=["-fopenmp"],
         is_python_module=False)


def stable_sources(name: str, sources) -> list[str]:
    """`sources` (with every header of csrc/) copied once to a folder named after the library,
    whose name carries their hash: torch's loader writes the sources' absolute paths into its
    build file, so building from the checkout rebuilt the library for every checkout path (a
    scratch clone, a worktree) and again on switching back. From these copies it builds once per
    source and machine."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    dst = root / "specstop-src" / name
    if not dst.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{name}."))
        for f in {*map(Path, sources), *CSRC.glob("*.h")}:
            shutil.copy2(f, tmp / f.name)
        try:
            os.replace(tmp, dst)
        except OSError:  # another process put the same copies there first
            shutil.rmtree(tmp, ignore_errors=True)
    return [str(dst / Path(p).name) for p in sources]


def source_digest(sources) -> str:
    """A library's sources and every header beside them: torch's loader rebuilds on a changed
    source but not on a changed header, so the hash goes into the library's name."""
    files = sorted({*map(Path, sources), *CSRC.glob("*.h")})
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:12]


def _load() -> str | None:
    """Build / load the ops once per process; None when they are ready, else why not."""
    if os.environ.get(ENV, "").strip() == "0":
        return f"${ENV}=0"
    cpu.warn_torch_isa()
    missing = [f for f in FLAGS if f not in cpu.flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if _registered():
        return None
    try:
        _build()
    except Exception as e:  # no compiler, no ninja, a read-only cache: the oneDNN path still works
        lines = str(e).splitlines() or [""]
        first = next((ln for ln in lines if "error" in ln.lower() and ln is not lines[0]), lines[0])[:200]
        why = f"the kernel did not build ({type(e).__name__}: {first})"
        warnings.warn(f"decoding.forward.kernels: {why}; linears stay oneDNN's", stacklevel=3)
        return why
    return None


def why_not() -> str | None:
    """None when the kernels are usable in this process, else one phrase why not."""
    if "why" not in _state:
        _state["why"] = _load()
    return _state["why"]


def available() -> bool:
    return why_not() is None


def amx() -> bool:
    """bf16 linears run on AMX tiles here (the CPU has them and the OS grants their state)."""
    if "amx" not in _state:
        _state["amx"] = (available() and all(f in cpu.flags() for f in AMX_FLAGS)
                         and bool(ops.amx_ready()))
    return _state["amx"]


def rows_below(dtype: torch.dtype) -> int:
    """Row counts below which a linear in `dtype` runs on these kernels here (0: never)."""
    if not available():
        return 0
    if dtype == torch.bfloat16 and amx():
        return AMX_ROWS + 1  # tiles: one kernel for a step and every verify
    if dtype == torch.float32:
        return PANEL_ROWS + 1
    return ROWS_BELOW.get(dtype, 0)


def attention_rows(dtype: torch.dtype) -> int:
    """Most rows a lean forward in `dtype` attends with `row_attention` (0: torch's attention)."""
    if not batch_invariant():
        return 0
    return AMX_ROWS if dtype == torch.bfloat16 and amx() else PANEL_ROWS


def batch_invariant() -> bool:
    """The lean layers attend with `row_attention`: the kernels are built and $SPECSTOP_BATCH_INVARIANT
    is not 0 (see INVARIANT_ENV)."""
    return os.environ.get(INVARIANT_ENV, "").strip() != "0" and available()


def describe() -> str:
    """What runs few-row linears here, in a few words (reports, bench headers)."""
    if not available():
        return f"oneDNN (few-row kernels off: {why_not()})"
    return (("AMX tiles" if amx() else "AVX512-BF16 dot products") + " for bf16, AVX512F panels for fp32"
            + (", batch-invariant attention" if batch_invariant() else ""))


class FewRowWeight:
    """A weight [N, K] prepared for this CPU's few-row kernel: AMX tiles (bf16), panels (fp32),
    else row-major (bf16 without AMX)."""

    def __init__(self, w: torch.Tensor):
        self.n = w.shape[0]
        w = w.detach()
        if w.dtype == torch.bfloat16 and amx():
            self.w, self.op = ops.amx_pack(w), ops.amx_linear.default
        elif w.dtype == torch.float32:
            self.w, self.op = ops.panel_pack(w), ops.panel_linear.default
        else:
            self.w, self.op = w.contiguous(), None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] (contiguous, the weight's dtype) @ w.T + bias -> [T, N]."""
        if self.op is not None:
            return self.op(x, self.w, self.n, bias)
        return ops.small_linear(x, self.w, bias)


def gather(weights) -> int:
    """Move the packed weights of `weights` (FewRowWeight, in the order a forward reads them) into
    one arena of 2 MiB pages per dtype (`csrc/arena.cpp`): no TLB miss every 4 KiB of the stream,
    and each weight's prefetch runs on into the next one. Weights already in an arena, or kept
    row-major, stay. Returns the bytes moved ($SPECSTOP_HUGE_PAGES=0: none)."""
    if os.environ.get(PAGES_ENV, "").strip() == "0":
        return 0
    todo: dict = {}
    for w in weights:
        if w is not None and w.op is not None and not getattr(w, "in_arena", False):
            todo.setdefault(w.w.dtype, []).append(w)
    moved = 0
    for dt, ws in todo.items():
        arena = ops.huge_empty(sum(w.w.numel() for w in ws), dt)
        off = 0
        for w in ws:  # every packed size is a multiple of 64 bytes: each weight starts on a cache line
            n = w.w.numel()
            w.w = arena[off:off + n].view(w.w.shape).copy_(w.w)
            w.in_arena, off = True, off + n
        moved += off * arena.element_size()
    return moved


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w[N, K].T + bias on the row-major kernel (both contiguous, one dtype)."""
    return ops.small_linear(x, w, bias)
