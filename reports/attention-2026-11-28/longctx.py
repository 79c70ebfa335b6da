"""Batch-1 generate after a long prompt: `python longctx.py ar|default N` (prompt ~N tokens, 128 new), tok/s of 2 passes."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
import decoding
strategy = sys.argv[1] if sys.argv[1] != "default" else None
n = int(sys.argv[2])
dec = Decoder.load(strategy=strategy) if strategy else Decoder.load()
eng = dec.engine(__import__("decoding.sampling", fromlist=["SamplingConfig"]).SamplingConfig())
text = open(decoding.__file__.replace("__init__.py", "engine.py")).read()
ids = dec.prompt_ids("Summarise what this code does:\n" + text, chat=True, max_new_tokens=128)
ids = ids[-n:]
eos = dec.session.eos_token_id
eng.generate(ids[:64], 8, eos)
res = []
for rep in range(2):
    t = time.perf_counter(); eng.generate(ids, 1, eos); pre = time.perf_counter() - t
    t = time.perf_counter(); out, st = eng.generate(ids, 128, eos); tot = time.perf_counter() - t
    res.append(f"prefill {1e3*pre:.0f} ms, then {(len(out) - 1) / (tot - pre):.1f} tok/s")
print(decoding.__file__.split("/decoding/")[0], dec.config.name, len(ids), " | ".join(res), flush=True)
