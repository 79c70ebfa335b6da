"""A prompt's forward by op (torch profiler), the layers run a call an op (one_call off)."""
import time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.serve.__main__ import batch_engine
dec = Decoder.load(strategy="ar")
m = dec.session.target
for layer in m.model.layers:
    layer._lean["one_call"] = 0
    layer._lean.pop("stack", None)
eos = dec.session.eos_token_id
base = dec.prompt_ids("Explain recursion to a beginner, step by step, with examples. " * 30, chat=True, max_new_tokens=8)
print("prompt", len(base))
for n in (64, 128, 256):
    p = base[:n]
    for _ in range(2):
        e = batch_engine(dec); r = e.add(p, 1, eos_token_id=eos); e.step()
    e = batch_engine(dec); r = e.add(p, 1, eos_token_id=eos)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter(); e.step(); wall = time.perf_counter() - t
    print(f"== {n} tokens: {1e3*wall:.1f} ms")
    rows = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:6]
    for k in rows:
        print(f"   {k.key:45s} {k.self_cpu_time_total/1e3:7.1f} ms  x{k.count}")
