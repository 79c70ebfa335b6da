"""Kernel alone: the AVX512 row attention (specstop::row_attention) over a 256-token prompt, causal and every key seen, 1 and 2 threads (best of 20)."""
import time, torch
from decoding.forward import kernels
kernels.available()
T, H, KV, D = 256, 9, 3, 64
q = torch.randn(1, H, T, D); k = torch.randn(1, KV, T, D); v = torch.randn(1, KV, T, D)
vis = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
for th in (1, 2):
    torch.set_num_threads(th)
    for name, m in (("causal", vis), ("full", torch.ones_like(vis))):
        for _ in range(3): torch.ops.specstop.row_attention(q, k, v, m, 0.125)
        best = 1e9
        for _ in range(20):
            t = time.perf_counter(); torch.ops.specstop.row_attention(q, k, v, m, 0.125); best = min(best, time.perf_counter() - t)
        print(th, name, f"{best*1e6:.0f} us")
