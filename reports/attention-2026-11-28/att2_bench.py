"""Kernel alone: the AVX2 row attention (specstop_quant::row_attention): a step, a verify of 8 rows and a 256-token prompt, 1 and 2 threads (best of 30)."""
import time, torch
from decoding.forward import quant
quant.available(); ops = quant.ops
H, KV, D = 9, 3, 64
def bench(T, N, th):
    torch.set_num_threads(th)
    q = torch.randn(1, H, T, D); k = torch.randn(1, KV, N, D); v = torch.randn(1, KV, N, D)
    m = torch.ones(T, N, dtype=torch.bool); m[:, N - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    m = m[None, None]
    for _ in range(3): ops.row_attention(q, k, v, m, 0.125)
    best = 1e9
    for _ in range(30):
        t = time.perf_counter(); ops.row_attention(q, k, v, m, 0.125); best = min(best, time.perf_counter() - t)
    return best * 1e6
for T, N in ((1, 100), (1, 400), (8, 400), (256, 256)):
    print(T, N, " ".join(f"{bench(T, N, th):.0f}us@{th}t" for th in (1, 2)))
