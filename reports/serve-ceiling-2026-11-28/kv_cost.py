"""Batched `ar` rounds of 1 and 4 requests at 32 / 160 / 400 cached tokens: the round and the 30
layers' call (ms, best of 3 runs of 40 rounds). `python kv_cost.py [float16]` (float16: the KV cache's dtype)."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
import decoding.batch.forward as bf
from decoding.batch.scheduler import BatchEngine
from decoding.kv_cache import set_kv_dtype
dec = Decoder.load(strategy="ar"); s = dec.session
if len(sys.argv) > 1: set_kv_dtype(s.target, sys.argv[1])
base = dec.prompt_ids("Explain recursion to a beginner, step by step, with examples. " * 40, chat=True, max_new_tokens=8)
T = {}
f = bf._one_call_stack
def g(*a, **k):
    t = time.perf_counter(); out = f(*a, **k); T["stack"] = T.get("stack", 0) + time.perf_counter() - t; return out
bf._one_call_stack = g
for L in (32, 160, 400):
  for n in (1, 4):
    res = []
    for rep in range(3):
        e = BatchEngine(s.target, None)
        reqs = [e.add(base[i:i + L], 200, eos_token_id=[]) for i in range(n)]
        for _ in range(3): e.step()
        T.clear(); k = 40
        t = time.perf_counter()
        for _ in range(k): e.step()
        res.append(((time.perf_counter() - t) / k * 1e3, T["stack"] / k * 1e3))
    b = min(res)
    print(f"ctx {L} n={n}: round {b[0]:.2f} ms, stack {b[1]:.2f}", flush=True)
