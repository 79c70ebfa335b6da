"""Kernel alone: the AVX2 row attention over a float16 KV cache (16 rows at 400 keys, a 256-token prompt), 1 and 2 threads, best of 20."""
import time, torch
from decoding.forward import quant
quant.available(); ops = quant.ops
H, KV, D = 9, 3, 64
for th in (1, 2):
    torch.set_num_threads(th)
    for T, N in ((16, 400), (256, 256)):
        q = torch.randn(1, H, T, D); k = torch.randn(1, KV, N, D).half(); v = torch.randn(1, KV, N, D).half()
        m = torch.ones(T, N, dtype=torch.bool); m[:, N - T:] = torch.ones(T, T, dtype=torch.bool).tril(); m = m[None, None]
        for _ in range(3): ops.row_attention(q, k, v, m, 0.125)
        b = 1e9
        for _ in range(20):
            t = time.perf_counter(); ops.row_attention(q, k, v, m, 0.125); b = min(b, time.perf_counter() - t)
        print(th, T, N, f"{b*1e6:.0f} us", flush=True)
