"""A cheaper target forward on a CPU: every nn.Linear runs on a oneDNN-prepacked copy of its weight.

Where a target forward's time goes (`python -m decoding.bench --suite forward`): on a 2-core
AVX512 CPU the GEMMs are ~85% of it, and torch's default kernel for a linear of 2-16 rows (the
rows a verify carries) is the slow one: an fp32 forward of 2 rows costs ~2x one of 1 row. A
prepacked oneDNN weight (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing
pass packs) keeps small row counts near one row's cost, and in bfloat16 it reaches the CPU's
AVX512-BF16 dot products, which the default bf16 linear does not.

`pack_linears(model)` keeps every parameter (names, values: fingerprints and tied weights are
unchanged) and only swaps how each Linear computes; `unpack_linears` restores the reference
(eager) path. The packed copy costs one more copy of the linear weights in memory. The result
equals the reference to rounding (not bitwise). In bfloat16 a row's result does not depend on
how many rows a forward carries, so a verify and a plain step agree on a shared row; in float32
a forward of fewer than 4 rows (a plain step, a small verify) keeps the default kernel, faster
there (EAGER_BELOW), and agrees with a larger verify's row to rounding.

`set_forward(model, "lean")` goes one step further for Llama-family layers
(decoding.forward.lean: fused q/k/v and gate/up linears, fused norms): the default here.
"""

from __future__ import annotations

import os
import types

import torch

from decoding.forward import kernels as cpu_kernels
from decoding.forward.lean import QUANT_ROWS, make_lean, rebind, unmake_lean
from decoding.options import ALL_FORWARDS, FORWARDS  # noqa: F401  (FORWARDS: re-exported)
REVISION = 10
"""Bumped when what the packed forward runs changes (3: float32 below 4 rows on the eager
kernel; 4: few rows on decoding.forward.kernels; 5: steps and verifies attend on them; 6: float32
linears of 1-32 rows on their panels; 7: a feature head's steps on them, decoding.drafts.lean_step;
8: bf16 up to 65 rows on AMX; 9: fp32 panels of 48 outputs, 8 rows a pass, streamed into L2;
10: a lean layer in one kernel call, the packed weights in 2 MiB pages);
stored cost curves are keyed by it (decoding.forward.cost_cache)."""
ENV = "SPECSTOP_FORWARD"
"""Environment override of the default forward (eager or packed)."""
BATCH_HINT = 16
"""Rows oneDNN packs the weight for (a tree's forward carries 1-64 new tokens)."""
EAGER_BELOW = {torch.float32: 4}
"""Row counts below which a linear keeps the default kernel: in float32 the packed one cost
1.27x / 1.24-1.31x the eager one at 1 / 2 rows and 0.76-0.89x at 4-16 on a 2-core AMX Xeon, 1
thread (reports/forward-2026-11-26-amx*); in bfloat16 packed wins at every size."""


def packed_available(dtype: torch.dtype, device) -> bool:
    """oneDNN prepacked linears exist for this dtype on this device (CPU with mkldnn; bf16
    also needs the CPU's bf16 support, which torch checks)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def default_forward(dtype: torch.dtype, device) -> str:
    """lean where oneDNN packs (its layers fall back to packed outside the Llama family): on a
    2-core AMX Xeon, 1 thread, bf16 lean costs 0.87x packed at 1 token and 0.83-0.87x at 2-16,
    fp32 lean 0.95x / 0.82-0.90x packed (reports/forward-2026-11-26-lean); on CUDA graph: on an
    H100 one bf16 forward of the embedded target costs 3.2 ms captured against 65 ms eager
    (reports/gpu-2026-11-27); else eager. $SPECSTOP_FORWARD overrides."""
    asked = os.environ.get(ENV, "").strip()
    if asked:
        if asked not in ALL_FORWARDS:
            raise ValueError(f"{ENV} must be one of {', '.join(ALL_FORWARDS)} (got {asked!r})")
        return asked if asked != "packed" or packed_available(dtype, device) else "eager"
    if torch.device(device).type == "cuda":
        return "graph"
    return "lean" if packed_available(dtype, device) else "eager"


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """A linear weight prepacked by oneDNN, None where it cannot be."""
    if not packed_available(w.dtype, w.device):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), BATCH_HINT)


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    if x.dtype != self._packed_dtype or x.device.type != "cpu":
        return torch.nn.functional.linear(x, self.weight, self.bias)  # e.g. an fp32 head over bf16
    x2 = x.reshape(-1, x.shape[-1])
    if rows < self._small_below:
        y = self._few(x2.contiguous(), self.bias)
    elif rows < self._eager_below:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2, self._packed_weight, self.bias, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])


def kernel_rows(kernels: bool) -> dict:
    """dtype -> rows below which linears run on decoding.forward.kernels ({} when `kernels` is off)."""
    return {dt: cpu_kernels.rows_below(dt) for dt in (torch.float32, torch.bfloat16)} if kernels else {}


@torch.no_grad()
def pack_linears(model: torch.nn.Module, kernels: bool = True) -> int:
    """Give every CPU nn.Linear of `model` in float32 / bfloat16 a prepacked weight and the
    packed forward; returns how many were packed (0 where oneDNN cannot: the model is unchanged).
    `kernels`: few rows run on decoding.forward.kernels where they are built (rows_below)."""
    n = 0
    below = None  # built on the first packable linear (a CUDA model never builds the kernel)
    for mod in model.modules():
        if type(mod) is not torch.nn.Linear or hasattr(mod, "_packed_weight") or hasattr(mod, "_lean_fused"):
            continue
        w = mod.weight
        if not packed_available(w.dtype, w.device):
            continue
        mod._packed_dtype = w.dtype
        if getattr(mod, "_quant", None) is not None:  # a GGUF's blocks, at every row count
            q = mod._quant if forward_kind(model) == "lean" else mod._quant.for_torch_attention()
            mod._packed_weight, mod._eager_below, mod._small_below, mod._few = None, 0, QUANT_ROWS, q
        else:
            mod._packed_weight = pack_weight(w)
            mod._eager_below = EAGER_BELOW.get(w.dtype, 0)
            below = kernel_rows(kernels) if below is None else below
            mod._small_below = below.get(w.dtype, 0)
            mod._few = cpu_kernels.FewRowWeight(w) if mod._small_below else None
        mod.forward = types.MethodType(_packed_forward, mod)
        n += 1
    if n and forward_kind(model) != "lean":  # n == 0: as it was (eager, or already packed)
        model._specstop_forward = "packed"
    return n


def unpack_linears(model: torch.nn.Module) -> None:
    """Back to the reference (eager) forward."""
    unmake_lean(model)
    model.__dict__.pop("_lean_step", None)  # a feature head's fused copies (decoding.drafts.lean_step)
    for mod in model.modules():
        if hasattr(mod, "_packed_weight"):
            del mod._packed_weight, mod._packed_dtype, mod._eager_below, mod._small_below, mod._few
            del mod.forward
    model._specstop_forward = "eager"


def forward_kind(model: torch.nn.Module) -> str:
    """Which forward a model runs: eager (as loaded), packed, lean, static or graph."""
    return getattr(model, "_specstop_forward", "eager")


def set_forward(model: torch.nn.Module, kind: str, kernels: bool = True) -> str:
    """Switch a model to `kind` (FORWARDS); returns the kind it runs: lean falls back to packed
    where a layer is not of a known family, packed to eager where oneDNN cannot pack. `kernels`:
    decoding.forward.kernels where they are built (off: torch's ops and oneDNN's linears only)."""
    if kind not in ALL_FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(ALL_FORWARDS)} (got {kind!r})")
    if kind == "graph":
        dev = next(model.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"--forward graph needs a CUDA device (the model is on {dev.type}); "
                             f"--forward static runs the same static cache without graphs")
    if kind == forward_kind(model) and kernels == getattr(model, "_specstop_kernels", True):
        return kind
    unpack_linears(model)
    model.__dict__.pop("_specstop_kv_dtype", None)  # a new forward stores the model's dtype (set_kv_dtype again)
    model._specstop_kernels = kernels
    if kind in ("static", "graph"):  # the eager modules over decoding.forward.static's cache
        model._specstop_forward = kind
        return kind
    if kind == "lean" and make_lean(model, pack_weight, EAGER_BELOW, kernel_rows(kernels)):
        model._specstop_forward = "lean"
    if kind != "eager":
        pack_linears(model, kernels)
        if cpu_kernels.gather(few_row_weights(model)):
            rebind(model)
    return forward_kind(model)


def few_row_weights(model: torch.nn.Module) -> list:
    """The model's weights packed for decoding.forward.kernels, in the order a forward reads them."""
    out = []
    for mod in model.modules():
        if hasattr(mod, "_lean"):
            out += [mod._lean[k].few for k in ("qkv", "o", "gate_up", "down")]
        elif getattr(mod, "_few", None) is not None:
            out.append(mod._few)
    return out
