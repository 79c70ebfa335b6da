"""The forward suite's roofline: the least a forward of n tokens can cost on this machine.

A forward reads every weight once and the cache once, and does two flops per weight per token plus
the attention's; so it cannot take less than max(bytes / read rate, flops / peak). The read rate
and the peaks are MEASURED here (decoding/bench/csrc/peaks.cpp, built for the benchmark only), at the suite's thread count, not read
from a datasheet. bound(n) / bound(1) is what a verify of n tokens must cost over a step on this
hardware; a variant's time over its bound is how far the software is from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Peaks:
    """One machine's measured best, summed over `threads` cores."""

    threads: int
    read_gbps: float
    """Streaming reads of a buffer far larger than the caches, prefetched as the kernels do."""
    fp32_gflops: float
    """512-bit fp32 FMAs, 12 independent chains per thread."""
    bf16_gflops: float
    """bf16 products: AMX tile dot products where the CPU has them, else AVX512-BF16 pairs."""
    bf16_unit: str

    def peak(self, dtype: torch.dtype) -> float:
        return self.bf16_gflops if dtype == torch.bfloat16 else self.fp32_gflops

    def to_dict(self) -> dict:
        return asdict(self)


def measure(threads: int, repeats: int = 3, read_mib: int = 512, fma_iters: int = 20_000_000) -> Peaks | None:
    """The best of `repeats` probes at `threads` threads; None where the probes do not build
    (they need the CPU kernels' AVX512 flags)."""
    from decoding.forward import kernels

    if not kernels.available() or not _build_probes():
        return None
    ops, before = kernels.ops, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:  # best, not median: a probe can only be slowed by the machine, never sped up
        read = max(ops.read_gbps(read_mib) for _ in range(repeats))
        fp32 = max(ops.fp32_fma_gflops(fma_iters) for _ in range(repeats))
        bf16 = max(ops.bf16_gflops(fma_iters // 10) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return Peaks(threads, read, fp32, bf16, "AMX tiles" if kernels.amx() else "AVX512-BF16")


def _build_probes() -> bool:
    """The probes, a library of their own (the runtime kernels do not carry them)."""
    from pathlib import Path

    from torch.utils.cpp_extension import load

    from decoding.forward import kernels

    if hasattr(kernels.ops, "read_gbps"):
        return True
    src = Path(__file__).parent / "csrc" / "peaks.cpp"
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"]
    try:
        load(f"specstop_peaks_{kernels.source_digest([src])}", [str(src)], extra_cflags=flags,
             extra_include_paths=[str(kernels.CSRC)], extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception:  # no compiler: the suite runs without its roofline
        return False
    return True


@dataclass
class Work:
    """What one forward of a model has to read and compute, by its shapes."""

    weight_bytes: int
    """Every linear's weight, once (a tied output layer counted once)."""
    linear_params: int
    kv_bytes_per_token: int
    """Keys and values of one cached token, every layer."""
    attention_flops_per_pair: int
    """Scores and the weighted values of one query token against one key, every layer."""

    def bytes(self, n: int, context: int) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * (context + n)

    def flops(self, n: int, context: int) -> int:
        return 2 * n * self.linear_params + self.attention_flops_per_pair * n * (context + n)


def work_of(model: torch.nn.Module) -> Work:
    """The Work of `model` as loaded (its dtype): linears found by module type, attention shapes
    from the config (0 where the config does not name them)."""
    seen, params, nbytes = set(), 0, 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.data_ptr() not in seen:
            seen.add(mod.weight.data_ptr())
            params += mod.weight.numel()
            nbytes += mod.weight.numel() * mod.weight.element_size()
    cfg = getattr(model.config, "text_config", model.config)
    layers, heads = getattr(cfg, "num_hidden_layers", 0), getattr(cfg, "num_attention_heads", 0)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0)
    size = next(model.parameters()).element_size()
    return Work(nbytes, params, 2 * layers * kv * head_dim * size, 4 * layers * heads * head_dim)


def bound_ms(work: Work, n: int, context: int, dtype: torch.dtype, peaks: Peaks) -> dict:
    """The least a forward of n new tokens over `context` cached ones can cost, and its two sides."""
    memory = work.bytes(n, context) / (peaks.read_gbps * 1e9) * 1e3
    compute = work.flops(n, context) / (peaks.peak(dtype) * 1e9) * 1e3
    return {"ms": max(memory, compute), "memory_ms": memory, "compute_ms": compute}


def suite_rows(work: dict, sizes, context: int, peaks: Peaks, median_ms: dict) -> dict:
    """For the forward suite: per dtype the bound at every size, per variant its time over it.
    `work` maps a dtype name to its Work; variants are named '<dtype> <forward>'."""
    bounds = {dt: {n: bound_ms(w, n, context, getattr(torch, dt), peaks) for n in sizes} for dt, w in work.items()}
    over = {name: {n: med[n] / bounds[name.split()[0]][n]["ms"] for n in sizes}
            for name, med in median_ms.items() if name.split()[0] in bounds}
    return {"peaks": peaks.to_dict(), "bound": bounds, "over_bound": over}


def markdown(rf: dict, sizes, threads) -> list[str]:
    """The suite report's roofline section for one thread count."""
    pk, head = rf["peaks"], " | ".join(f"n={n}" for n in sizes)
    lines = [f"Roofline, measured here on {threads} thread(s): reads {pk['read_gbps']:.1f} GB/s, fp32 FMAs "
             f"{pk['fp32_gflops']:.0f} GFLOP/s, bf16 {pk['bf16_gflops']:.0f} GFLOP/s ({pk['bf16_unit']}). The least a "
             "forward can cost, max(weights and cache / read rate, flops / peak), ms [over the 1-token bound]:", "",
             f"| dtype | {head} |", "|---|" + "---|" * len(sizes)]
    for dt, b in rf["bound"].items():
        lines.append(f"| {dt} | " + " | ".join(f"{b[n]['ms']:.1f} [{b[n]['ms'] / b[sizes[0]]['ms']:.2f}]" for n in sizes) + " |")
    lines += ["", "Each variant's time over its dtype's bound:", "", f"| variant | {head} |", "|---|" + "---|" * len(sizes)]
    for name, x in rf["over_bound"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x[n]:.2f}" for n in sizes) + " |")
    return lines + [""]
