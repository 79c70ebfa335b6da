"""What this CPU is, read once from /proc/cpuinfo (Linux; nothing elsewhere): its flags, its
model name, and which dtype it computes fastest. The one reader: the kernels' build check, the
bf16 defaults, the cost-curve key and the benchmarks all ask here. Torch-free, so the CLI can
check options before it imports torch."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from pathlib import Path

CPU_ENV = "SPECSTOP_CPU"
"""avx2: act as an AVX2-only CPU on a bigger one, so one machine tests and measures the AVX2 class:
the flags lose AVX512, AMX and AVX-VNNI (our AVX512 kernels stand down, the quantized kernel takes
its AVX2 path, fp32 is the fast dtype), and torch's own kernels are held to AVX2 (ATen's dispatch,
oneDNN's ISA) where this module loads before torch. Empty: the CPU as it is."""
_DROPPED = ("avx512", "amx", "avx_vnni")
# torch reads these once, when it loads: set them before that (`make test-avx2` sets them outright)
TORCH_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def emulated() -> str:
    """The CPU class $SPECSTOP_CPU asks to act as ('' for none)."""
    asked = os.environ.get(CPU_ENV, "").strip().lower()
    if asked not in ("", "avx2"):
        raise ValueError(f"${CPU_ENV} must be avx2 or empty (got {asked!r})")
    return asked


if emulated() and "torch" not in sys.modules:
    for _k, _v in TORCH_ENV.items():
        os.environ.setdefault(_k, _v)


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(cpuinfo: str, key: str) -> str | None:
    for line in cpuinfo.splitlines():
        if line.startswith(key):
            return line.split(":", 1)[-1].strip()
    return None


def flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (the first processor's; empty where unknown), less what
    $SPECSTOP_CPU hides."""
    found = set((_field(_cpuinfo() if cpuinfo is None else cpuinfo, "flags") or "").split())
    if cpuinfo is None and emulated():
        found = {f for f in found if not f.startswith(_DROPPED)}
    return found


def describe() -> str:
    """The CPU model and the flags that decide the dtype and kernels (AMX, AVX512-BF16): what a
    report says its figures ran on."""
    names = sorted(flags() & {"amx_bf16", "avx512_bf16"})
    return model_name() + (f" ({', '.join(names)})" if names else "")


def model_name() -> str:
    name = _field(_cpuinfo(), "model name") or platform.processor() or platform.machine()
    return name + (f" (as {emulated().upper()} only)" if emulated() else "")


@lru_cache(maxsize=1)
def warn_torch_isa() -> None:
    """Warn (once) where torch does not run as $SPECSTOP_CPU asks: it loaded before the variables
    were set, so its timings are the bigger CPU's."""
    if not emulated() or "torch" not in sys.modules:
        return
    import warnings

    import torch

    got = torch.backends.cpu.get_cpu_capability()
    if got.upper() not in ("AVX2", "DEFAULT") or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() != "AVX2":
        warnings.warn(f"${CPU_ENV}={emulated()} but torch's kernels run {got}: set "
                      + " ".join(f"{k}={v}" for k, v in TORCH_ENV.items()) + " before torch loads",
                      stacklevel=3)


def native_bf16() -> bool:
    """The CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16); True where flags are unknown."""
    found = flags()
    return not found or bool({"avx512_bf16", "amx_bf16"} & found)


def packed_forward() -> bool:
    """Whether the packed forward is the default here (decoding.forward.packed falls back to
    eager where oneDNN lacks it)."""
    return os.environ.get("SPECSTOP_FORWARD", "").strip() != "eager"


def prefers_bf16(cpuinfo: str | None = None, packed: bool | None = None) -> bool:
    """AMX-BF16 in the CPU flags, or AVX512-BF16 where the packed forward runs (`packed` None:
    unless $SPECSTOP_FORWARD is eager). On a 2-core AVX512-BF16 EPYC without AMX (torch 2.13,
    shared machine, interleaved): the eager bf16 forward is no faster than fp32 at 1
    token (float32 decoded 1.175x faster, reports/dtype-2026-11-26), while the packed bf16
    forward costs 0.5-0.84x the fp32 eager one at 1-16 tokens (reports/forward-2026-11-26) and
    decodes 1.2-1.4x faster. On a 2-core AMX Xeon (quiet, 1 thread): bf16 eager 1.02x fp32 at 1
    token, bf16 packed 0.79x, and 0.43-0.54x at 4-16 tokens (reports/forward-2026-11-26-amx).
    Without either flag, bf16 matmuls are emulated and slower."""
    found = flags(cpuinfo)
    if packed is None:
        packed = packed_forward()
    return "amx_bf16" in found or ("avx512_bf16" in found and packed)
