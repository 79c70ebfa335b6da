"""Attention and layer code A/B on ONE loaded bf16 target (the same packed weights), interleaved
call by call, 1 thread, 200 cached tokens: separate model copies differ by up to ~10% in their
GEMM time alone (where the weights land), which swamps a 1-2 ms difference between variants.
  default  = the trimmed kernel layer (`_kernel_layer_forward`) + row_attention
  untrimmed = transformers-shaped lean layer (`_lean_layer_forward`) + row_attention
  sdpa     = `_lean_layer_forward` + torch's scaled_dot_product_attention (the previous default)
Run from the repository root: .venv/bin/python reports/forward-2026-11-27-row-attention/same_weights_ab.py"""
import statistics
import types

import torch

from decoding import cpu_kernels, lean_forward
from decoding.bench.forward import _variants

torch.set_num_threads(1)
f = _variants(["bfloat16"], ["lean"], 200, [1])["bfloat16 lean"]
layers = f.m.model.model.layers
VARIANTS = {"default": (lean_forward._kernel_layer_forward, cpu_kernels.AMX_ROWS + 1),
            "untrimmed": (lean_forward._lean_layer_forward, cpu_kernels.AMX_ROWS + 1),
            "sdpa": (lean_forward._lean_layer_forward, 0)}


def use(name):
    fn, below = VARIANTS[name]
    for layer in layers:
        layer.forward = types.MethodType(fn, layer)
        layer._lean["row_attention_below"] = below


sizes = (1, 4, 8, 16, 32)
ms = {(v, n): [] for v in VARIANTS for n in sizes}
for _ in range(15):
    for n in sizes:
        for v in VARIANTS:
            use(v)
            ms[v, n].append(f.time(n))
print("| variant | " + " | ".join(f"n={n}" for n in sizes) + " |\n|---|" + "---|" * len(sizes))
for v in VARIANTS:
    print(f"| {v} | " + " | ".join(f"{statistics.median(ms[v, n]):.1f} ms [{statistics.median(ms[v, n]) / statistics.median(ms['sdpa', n]):.2f}x]"
                                   for n in sizes) + " |")
print("\ncost over the variant's 1-token forward: " + "; ".join(
    f"{v} " + " / ".join(f"{statistics.median(ms[v, n]) / statistics.median(ms[v, 1]):.2f}" for n in sizes) for v in VARIANTS))
