"""How far 4 clients can get over one by one on this CPU, in process (the serve suite's workload):
the default server engine, its rounds forced plain or drafted, and an oracle whose drafting is
FREE (the joint budget prices the draft at 0 ms and the rounds' drafting time is taken off the
wall), each against the batch-1 engine serving the prompts one by one, modes in turn.
`python ceiling.py [turns]`; prints each mode's walls, its tok/s and ratio (medians), and the
one-by-one run's prompt (prefill) time."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "joint-decider-2026-11-28"))
from workload import loaded, serve_workload  # noqa: E402

import decoding.batch.budget as budget  # noqa: E402
from decoding.serve.__main__ import batch_engine  # noqa: E402

torch.set_num_threads(2)
dec, s, cfg, ids, eos, layout, cost = loaded()
free_draft, priced = (lambda self, n: 0.0), budget.RoundCost.draft


def run(n, mode):
    """(tok/s with the drafting time off the wall where mode is 'free', prompt-round seconds)."""
    e = batch_engine(dec, "joint")
    if mode in ("drafted", "free"):
        e.measured = None  # every round drafts
    if mode == "plain":
        e.measured.drafts = lambda k: False
    spent = {"propose": 0.0, "prompt": 0.0}
    step, propose = e.step, e._propose

    def timed_propose(reqs):
        t = time.perf_counter()
        out = propose(reqs)
        spent["propose"] += time.perf_counter() - t
        return out

    def timed_step():
        prompt = any(len(r.committed) - r.cache.length > 1 for r in e.active)
        t = time.perf_counter()
        out = step()
        if prompt:
            spent["prompt"] += time.perf_counter() - t
        return out
    e.step = timed_step
    if mode == "free":
        e._propose = timed_propose
        budget.RoundCost.draft = free_draft
    try:
        tps, tokens = serve_workload(e, ids, n, eos)
    finally:
        budget.RoundCost.draft = priced
    return tokens / (tokens / tps - spent["propose"]), spent["prompt"]


modes = [(1, "default"), (4, "default"), (4, "plain"), (4, "drafted"), (4, "free")]
run(1, "default")
res = {m: [] for m in modes}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for n, m in modes:
        res[(n, m)].append(run(n, m))
base = statistics.median(x[0] for x in res[(1, "default")])
for (n, m), v in res.items():
    tps = [x[0] for x in v]
    print(f"clients {n} {m:<8} {statistics.median(tps):6.1f} tok/s ({' '.join(f'{x:.0f}' for x in tps)}), "
          f"{statistics.median(tps) / base:.2f}x one by one; prompt rounds {statistics.median(x[1] for x in v):.2f} s",
          flush=True)
