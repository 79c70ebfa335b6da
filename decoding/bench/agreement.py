"""Greedy agreement with `ar`, with bf16 near-tie flips told apart from real mismatches.

Lossless speculative decoding reproduces `ar` token for token in exact arithmetic. In fp32 our
engine does so bit for bit, and any difference is a bug. In bf16 it cannot: a batched tree
verification sums in another order than a one-token step, so where the target's two best
logits are (nearly) tied, the rounded logits may pick either one, and which ties flip depends
on the CPU's kernels. So a bf16 difference is judged at the FIRST position where the outputs
part (everything after follows from it): recompute the target's logits there in float32 (the
same weights, upcast exactly; one forward of prompt + common prefix) and call it

- `tie`: both tokens lie within `TIE_ULPS` units in the last place of the dtype, taken at the
  top logit's magnitude, of the best logit: `max(top - l[ref], top - l[out]) <= tol`;
- `mismatch`: anything else (a genuine difference: a bug, or a lossy mode).

Why 8 ulps: the logits are rounded to bf16 (half an ulp each, one ulp on a difference), and the
final norm and output layer are computed in bf16 from a hidden state that itself carries
bf16 rounding of every layer, so the two computations' logits routinely differ by a few ulps.
8 ulps is about 3% of the logit's magnitude (bf16 keeps 8 significant bits): far below the
gaps a wrong verification produces (a rejected draft token is typically several logits
below the top), so real mismatches are not excused. Measured (reports/ties: SmolLM2 bf16 on
8 held-out prompts): every flip had a gap of at most 1.3 ulps, so 8 leaves room for CPUs whose
kernels round differently.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

TIE_ULPS = 8
"""Tolerance in units in the last place of the run's dtype, at the top logit's magnitude."""
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}
"""Explicit mantissa bits of the half-precision dtypes; float32 runs get no tolerance."""
KINDS = ("equal", "tie", "mismatch")

_FP32 = weakref.WeakKeyDictionary()  # model -> its float32 copy (built once per model)


@dataclass(frozen=True)
class GreedyCheck:
    kind: str
    """'equal', 'tie' (a near-tie flipped by the dtype's rounding) or 'mismatch'."""
    position: int | None = None
    """Index into the new tokens of the first difference (None when equal)."""
    gap: float | None = None
    """fp32 logit distance of the further of the two tokens below the top logit there."""
    tolerance: float | None = None
    """The largest gap that counts as a tie at that position (0 in float32)."""


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (the shorter one's length when one
    is a strict prefix of the other), None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ulp(x: float, dtype: str) -> float:
    """Spacing of the dtype's representable numbers at |x| (0 for float32: no tolerance)."""
    bits = MANTISSA_BITS.get(str(dtype).removeprefix("torch."))
    if bits is None:
        return 0.0
    x = abs(x)
    return 2.0 ** (math.floor(math.log2(x)) - bits) if x > 0 else 2.0 ** (-bits)


def tolerance(top_logit: float, dtype: str, ulps: int = TIE_ULPS) -> float:
    return ulps * ulp(top_logit, dtype)


def _fp32(model):
    if next(model.parameters()).dtype == torch.float32:
        return model
    if model not in _FP32:
        from decoding.forward.packed import forward_kind, set_forward

        kind = forward_kind(model)  # oneDNN's packed weights cannot be deep-copied: copy the eager model
        set_forward(model, "eager")
        try:
            _FP32[model] = copy.deepcopy(model).float().eval()
        finally:
            set_forward(model, kind)
    return _FP32[model]


@torch.inference_mode()
def fp32_logits(target, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after `ids`, computed in float32."""
    m = _fp32(target)
    x = torch.tensor([ids], device=next(m.parameters()).device)
    return m(input_ids=x).logits[0, -1].float().cpu()


def check_greedy(target, prompt_ids: list[int], ref_ids: list[int], out_ids: list[int],
                 dtype: str, ulps: int = TIE_ULPS) -> GreedyCheck:
    """Compare a candidate's greedy output with the reference (`ar`) for the same prompt."""
    i = first_difference(ref_ids, out_ids)
    if i is None:
        return GreedyCheck("equal")
    if i >= min(len(ref_ids), len(out_ids)):  # one stopped early: no token pair to weigh
        return GreedyCheck("mismatch", i)
    logits = fp32_logits(target, list(prompt_ids) + list(ref_ids[:i]))
    top = float(logits.max())
    gap = top - min(float(logits[ref_ids[i]]), float(logits[out_ids[i]]))
    tol = tolerance(top, dtype, ulps)
    # float32 (tol 0) stays bit for bit: even an exact tie must break the same way as in ar
    return GreedyCheck("tie" if 0 < tol and gap <= tol else "mismatch", i, gap, tol)


def count_kinds(checks) -> dict[str, int]:
    """{'equal': n, 'tie': n, 'mismatch': n} over GreedyChecks (or their kind strings)."""
    c = Counter(getattr(x, "kind", x) for x in checks)
    return {k: c.get(k, 0) for k in KINDS}
