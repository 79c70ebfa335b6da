"""bf16 forwards of 16-65 tokens on ONE loaded target (the same packed weights), interleaved, 200 cached
tokens: AMX linears + row_attention up to 32 rows then oneDNN + torch's attention (limit 33), against
AMX + row_attention up to 65 rows (limit 66, the default since AMX_ROWS = 65). Argument: threads.
Run from the repository root: .venv/bin/python reports/forward-2026-11-27-row-attention/rows_33_65.py [THREADS]"""
import statistics
import sys

import torch

from decoding.bench.forward import _variants

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
f = _variants(["bfloat16"], ["lean"], 200, [1])["bfloat16 lean"]
model = f.m.model
layers = model.model.layers


def use(limit):
    for layer in layers:
        L = layer._lean
        L["row_attention_below"] = limit
        for k in ("qkv", "o", "gate_up", "down"):
            L[k].small_below = limit
    model.lm_head._small_below = limit


sizes = (16, 33, 48, 65)
ms = {(v, n): [] for v in (33, 66) for n in sizes}
for _ in range(9):
    for n in sizes:
        for v in (33, 66):
            use(v)
            ms[v, n].append(f.time(n))
for n in sizes:
    a, b = statistics.median(ms[33, n]), statistics.median(ms[66, n])
    print(f"n={n}: oneDNN+sdpa above 32: {a:.1f} ms, AMX+row attention to 65: {b:.1f} ms, ratio {b/a:.2f}")
