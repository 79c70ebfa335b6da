"""The serve suite's workload in process (16 held-out prompts, N slots, no HTTP), the joint budget
with and without the cost curve's context term, in turn in one process: `python serve_ab.py`."""
import dataclasses, statistics, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.bench.serve_suite import held_out
from decoding.serve.__main__ import batch_engine
dec = Decoder.load()
ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
eos = dec.session.eos_token_id
def run(n, flat):
    e = batch_engine(dec, "joint")
    if flat:
        c = e.budget.cost
        e.budget.cost = dataclasses.replace(c, key_sizes=[], target_key_ms=[], draft_key_ms=[])
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
run(1, False)
for n in (1, 4):
    res = {"context term": [], "no context term": []}
    for turn in range(3):
        for k in res:
            res[k].append(run(n, k == "no context term"))
    print(n, {k: f"{statistics.median(v):.1f} ({' '.join(f'{x:.0f}' for x in v)})" for k, v in res.items()}, flush=True)
