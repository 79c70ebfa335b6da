"""One forward under torch.profiler: GEMM share of self CPU time, op count, top ops. A lean layer
run as one call (specstop::decoder_layer) hides its GEMMs from the profiler: its share is counted
apart (`layer_share`), most of it GEMMs."""

from __future__ import annotations

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_mkl_linear",
            "mkl::_mkl_linear", "specstop::small_linear", "specstop::amx_linear", "specstop::panel_linear")

LAYER_OPS = ("specstop::decoder_layer",)


def profile_one(call) -> dict:
    """Profile one `call()` on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        call()
    ka = p.key_averages()
    total = sum(e.self_cpu_time_total for e in ka) or 1
    gemm = sum(e.self_cpu_time_total for e in ka if e.key in GEMM_OPS)
    layer = sum(e.self_cpu_time_total for e in ka if e.key in LAYER_OPS)
    return {"ops": int(sum(e.count for e in ka)), "self_ms": total / 1000, "gemm_share": gemm / total, "layer_share": layer / total,
            "top": [(e.key, round(e.self_cpu_time_total / 1000, 2)) for e in
                    sorted(ka, key=lambda e: -e.self_cpu_time_total)[:5]]}
