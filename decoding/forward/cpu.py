"""What this CPU is, read once from /proc/cpuinfo (Linux; nothing elsewhere): its flags, its
model name, and which dtype it computes fastest. The one reader: the kernels' build check, the
bf16 defaults, the cost-curve key and the benchmarks all ask here. Torch-free, so the CLI can
check options before it imports torch."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path


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
    """The CPU's feature flags (the first processor's; empty where unknown)."""
    return set((_field(_cpuinfo() if cpuinfo is None else cpuinfo, "flags") or "").split())


def model_name() -> str:
    return _field(_cpuinfo(), "model name") or platform.processor() or platform.machine()


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
    shared machine, interleaved, issue 34): the eager bf16 forward is no faster than fp32 at 1
    token (float32 decoded 1.175x faster, reports/dtype-2026-11-26), while the packed bf16
    forward costs 0.5-0.84x the fp32 eager one at 1-16 tokens (reports/forward-2026-11-26) and
    decodes 1.2-1.4x faster. On a 2-core AMX Xeon (quiet, 1 thread): bf16 eager 1.02x fp32 at 1
    token, bf16 packed 0.79x, and 0.43-0.54x at 4-16 tokens (reports/forward-2026-11-26-amx).
    Without either flag, bf16 matmuls are emulated and slower."""
    found = flags(cpuinfo)
    if packed is None:
        packed = packed_forward()
    return "amx_bf16" in found or ("avx512_bf16" in found and packed)
