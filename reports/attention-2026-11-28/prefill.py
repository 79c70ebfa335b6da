"""A prompt's forward (prefill) by length: best of 4, ms and tok/s (`python prefill.py`)."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.serve.__main__ import batch_engine
import decoding.batch.forward as bf
dec = Decoder.load(strategy="ar")
eos = dec.session.eos_token_id
base = dec.prompt_ids("Explain recursion to a beginner, step by step, with examples. " * 30, chat=True, max_new_tokens=8)
T = {"layers": 0.0}
orig = bf._one_call_layer
for n in [8, 32, 64, 128, 256]:
    p = base[:n]
    best = 1e9
    for rep in range(4):
        e = batch_engine(dec)
        t = time.perf_counter()
        r = e.add(p, 1, eos_token_id=eos); e.step()
        best = min(best, time.perf_counter() - t)
    print(f"prefill {n:4d} tokens: {1e3*best:7.1f} ms, {n/best:7.0f} tok/s, {n*134.5e6/best/1e9:6.0f} GMAC/s", flush=True)
