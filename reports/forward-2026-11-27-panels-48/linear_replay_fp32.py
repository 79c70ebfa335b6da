"""Replay the 121 linears of one SmolLM2-135M step in float32 (cold random weights) on oneDNN's packed
kernel, the row-major kernel (`small_linear`) and the panels (`panel_linear`), interleaved, 1 thread.
Run from the repository root: .venv/bin/python reports/forward-2026-11-27-panels-48/linear_replay_fp32.py"""
import statistics
import time

import torch
from decoding import cpu_kernels
torch.set_num_threads(1)
assert cpu_kernels.available()
dt = torch.float32
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [[torch.randn(n, k, dtype=dt) * 0.02 for n, k in shapes] for _ in range(30)]
head = torch.randn(49152, 576, dtype=dt) * 0.02
pk = lambda w: (torch.ops.specstop.panel_pack(w), w.shape[0])
variants = {
    "oneDNN packed": ([[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in lw] for lw in ws],
                      torch.ops.mkldnn._reorder_linear_weight(head, 16),
                      lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    "small_linear": (ws, head, lambda x, w: cpu_kernels.linear(x, w)),
    "panel_linear": ([[pk(w) for w in lw] for lw in ws], pk(head), lambda x, w: torch.ops.specstop.panel_linear(x, w[0], w[1], None)),
}
x = torch.randn(5, 576)
ref = x.double() @ head.double().t()
for k, v in variants.items():
    print(k, "max err", float((v[2](x, v[1]).double() - ref).abs().max()))
def run(rows, layers, out, f):
    x1, x2 = torch.randn(rows, 576, dtype=dt), torch.randn(rows, 1536, dtype=dt)
    for lw in layers:
        f(x1, lw[0]), f(x1, lw[1]), f(x1, lw[2]), f(x2, lw[3])
    f(x1, out)
print("| rows | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
for rows in (1, 2, 4, 6, 8, 12, 16, 24, 32):
    ms = {k: [] for k in variants}
    for _ in range(5):
        for k, v in variants.items():
            if k == "small_linear" and rows > 8:
                continue
            t = time.perf_counter(); run(rows, *v); ms[k].append(1000 * (time.perf_counter() - t))
    print(f"| {rows} | " + " | ".join(f"{statistics.median(v):.1f} ms" if v else "–" for v in ms.values()) + " |", flush=True)
