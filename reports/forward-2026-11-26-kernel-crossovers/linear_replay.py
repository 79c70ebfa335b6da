"""Replay the 121 linears of one SmolLM2-135M step (30 layers of fused q/k/v, o, gate/up, down
over cold random bf16 weights, then the 49,152-row output layer) on oneDNN's packed kernel, the
row-major kernel (`small_linear`) and the AMX tiles (`amx_linear`), interleaved, 1 thread.
Run from the repository root: .venv/bin/python reports/forward-2026-11-26-kernel-crossovers/linear_replay.py"""
import statistics
import time

import torch

from decoding import cpu_kernels

torch.set_num_threads(1)
assert cpu_kernels.amx(), cpu_kernels.describe()
dt = torch.bfloat16
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [[torch.randn(n, k, dtype=dt) * 0.02 for n, k in shapes] for _ in range(30)]
head = torch.randn(49152, 576, dtype=dt) * 0.02
variants = {
    "oneDNN packed": ([[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in lw] for lw in ws],
                      torch.ops.mkldnn._reorder_linear_weight(head, 16),
                      lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    "small_linear": (ws, head, lambda x, w: cpu_kernels.linear(x, w)),
    "amx_linear": ([[cpu_kernels.FewRowWeight(w) for w in lw] for lw in ws], cpu_kernels.FewRowWeight(head),
                   lambda x, w: w(x)),
}


def run(rows, layers, out, f):
    x1, x2 = torch.randn(rows, 576, dtype=dt), torch.randn(rows, 1536, dtype=dt)
    for lw in layers:
        f(x1, lw[0]), f(x1, lw[1]), f(x1, lw[2]), f(x2, lw[3])
    f(x1, out)


print("| rows | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
for rows in (1, 2, 4, 8, 16, 32, 64):
    ms = {k: [] for k in variants}
    for _ in range(5):
        for k, v in variants.items():
            if k == "small_linear" and rows > 8:
                continue
            t = time.perf_counter()
            run(rows, *v)
            ms[k].append(1000 * (time.perf_counter() - t))
    print(f"| {rows} | " + " | ".join(f"{statistics.median(v):.1f} ms" if v else "–" for v in ms.values()) + " |")
