"""Batch-1 generate: the 8 bench chat prompts x 96 tokens, `python generate.py ar|default`, tok/s of 2 passes."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.batch.bench import PROMPTS
import decoding
strategy = sys.argv[1] if sys.argv[1] != "default" else None
dec = Decoder.load(strategy=strategy) if strategy else Decoder.load()
eng = dec.engine(__import__("decoding.sampling", fromlist=["SamplingConfig"]).SamplingConfig())
ids = [dec.prompt_ids(p, chat=True, max_new_tokens=96) for p in PROMPTS]
eos = dec.session.eos_token_id
eng.generate(ids[0], 8, eos)
res = []
for rep in range(2):
    t = time.perf_counter(); n = 0
    for p in ids:
        out, st = eng.generate(p, 96, eos); n += len(out)
    res.append(n / (time.perf_counter() - t))
print(decoding.__file__.split("/decoding/")[0], dec.config.name, " ".join(f"{r:.1f}" for r in res), flush=True)
