"""The serve suite's workload in process (16 held-out prompts, N slots each taking the next prompt
when its request ends; no HTTP): `python serve_workload.py 1,4 ar|default`, tok/s of 2 runs."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.bench.serve_suite import held_out
from decoding.serve.__main__ import batch_engine
import decoding
strategy = sys.argv[2] if sys.argv[2] != "default" else None
dec = Decoder.load(strategy=strategy) if strategy else Decoder.load()
ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
eos = dec.session.eos_token_id
def run(n):
    e = batch_engine(dec, "joint")
    queue = [ids[i::n] for i in range(n)]
    live, tokens = {}, 0
    def admit(c):
        if queue[c]: live[c] = e.add(queue[c].pop(0), 96, eos_token_id=eos)
    t = time.perf_counter()
    for c in range(n): admit(c)
    while live:
        done = {id(r) for r in e.step()}
        for c, r in list(live.items()):
            if id(r) in done: tokens += len(r.out); del live[c]; admit(c)
    return tokens / (time.perf_counter() - t)
run(1)
out = []
for n in [int(c) for c in sys.argv[1].split(",")]:
    out.append(f"n={n} " + " ".join(f"{run(n):.0f}" for _ in range(2)))
print(decoding.__file__.split("/decoding/")[0], dec.config.name, " | ".join(out), flush=True)
