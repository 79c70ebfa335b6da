"""What the joint budget expects a steady round to cost (its cost curve at the round's rows, plus its draft
feeds) against what the round took, on the serve workload in process: `python pricing.py`."""
import statistics, sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.bench.serve_suite import held_out
from decoding.growth import q_scores
from decoding.tree import layout_from_k_config
dec = Decoder.load(); s, cfg = dec.session, dec.config
ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
eos = s.eos_token_id
layout = layout_from_k_config(cfg.k_levels); cost = s.measured_cost()
print("curve target ms", {n: round(cost.target(n), 2) for n in (1, 2, 4, 8, 16, 32, 64)}, "draft", {n: round(cost.draft(n), 2) for n in (1, 2, 4, 8, 16)}, "overhead", cost.overhead_ms, "policy", cost.policy_ms, "context", cost.context)
def run(n, drafted):
    e = BatchEngine(s.target, s.draft, layout, budget=JointGrow(q_scores, cost, max_width=cfg.width, max_nodes=cfg.max_nodes)) if drafted else BatchEngine(s.target, None)
    b = e.budget
    queue = [ids[i::n] for i in range(n)]; live = {}; rec = []
    def admit(c):
        if queue[c]: live[c] = e.add(queue[c].pop(0), 96, eos_token_id=eos)
    for c in range(n): admit(c)
    while live:
        reqs = list(e.active); steady = all(len(r.committed) - r.cache.length == 1 for r in reqs)
        ctx = sum(r.cache.length for r in reqs) // len(reqs)
        t = time.perf_counter(); done = {id(r) for r in e.step()}; dt = 1e3 * (time.perf_counter() - t)
        if steady and len(reqs) == n:
            rows = e.verify_rows[-1]
            c = b._cost if b else cost.at_context(ctx)
            pred = (c.target(rows) + b._feeds + c.overhead_ms) if b else c.target(rows) + c.overhead_ms
            rec.append((rows, pred, dt))
        for c, r in list(live.items()):
            if id(r) in done: del live[c]; admit(c)
    return rec
run(1, True)
for n in (1, 4):
    for drafted in (False, True):
        rec = run(n, drafted)
        by = {}
        for rows, pred, dt in rec:
            k = rows if rows <= 8 else (16 if rows <= 16 else 32)
            by.setdefault(k, []).append((pred, dt))
        print(f"clients {n} {'joint q' if drafted else 'ar'}: {len(rec)} steady full rounds; predicted {statistics.mean(p for _, p, _ in rec):.2f} ms, actual {statistics.mean(d for _, _, d in rec):.2f} ms")
        for k in sorted(by):
            v = by[k]; print(f"    rows<={k}: {len(v)} rounds, predicted {statistics.mean(p for p, _ in v):.2f}, actual median {statistics.median(d for _, d in v):.2f}")
