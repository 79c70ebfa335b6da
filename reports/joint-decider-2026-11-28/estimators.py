"""The joint budget's estimate, in process on the serve suite's workload (16 held-out chat prompts,
N slots each taking its next prompt when a request ends, greedy, 96 new tokens; no HTTP): q, the
registry's latest decider, and a decider fitted on the joint budget's own rounds, the budget every
round (`joint-always`); batched `ar` beside them. Modes in turn, 3 turns, one process:

    python reports/joint-decider-2026-11-28/estimators.py RUN_ID [clients ...]
"""
import statistics, sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.bench.serve_suite import held_out
from decoding.growth import q_scores
from decoding.tree import layout_from_k_config

run_id, clients = sys.argv[1], [int(c) for c in sys.argv[2:]] or [1, 4]
dec = Decoder.load()
s, cfg = dec.session, dec.config
ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
eos = s.eos_token_id
layout = layout_from_k_config(cfg.k_levels)
cost = s.measured_cost()


def joint(scorer, label="q", needs_hidden=False):
    return lambda: BatchEngine(s.target, s.draft, layout, budget=JointGrow(
        scorer, cost, max_width=cfg.width, max_nodes=cfg.max_nodes, label=label, needs_hidden=needs_hidden))


def decider(name):
    g = s.decider_stop(name, "grow", None, cfg)
    return joint(g.scorer, "decider", g.needs_hidden)


modes = {"q": joint(q_scores), "latest decider": decider(None), f"joint-fitted {run_id}": decider(f"checkpoints/deciders/{run_id}"),
         "ar batched": lambda: BatchEngine(s.target, None)}


def run(make, n):
    e = make()
    queue = [ids[i::n] for i in range(n)]
    live, tokens = {}, 0

    def admit(c):
        if queue[c]:
            live[c] = e.add(queue[c].pop(0), 96, eos_token_id=eos)
    t = time.perf_counter()
    for c in range(n):
        admit(c)
    while live:
        done = {id(r) for r in e.step()}
        for c, r in list(live.items()):
            if id(r) in done:
                tokens += len(r.out)
                del live[c]
                admit(c)
    wall = time.perf_counter() - t
    return tokens / wall, tokens / e.rounds, sum(e.verify_rows) / e.rounds


run(modes["q"], 1)  # warm-up
for n in clients:
    res = {m: [] for m in modes}
    for turn in range(3):
        for m, make in modes.items():
            res[m].append(run(make, n))
    for m, v in res.items():
        tps = [x[0] for x in v]
        print(f"clients {n} {m:<40} {statistics.median(tps):6.1f} tok/s ({' '.join(f'{x:.0f}' for x in tps)}), "
              f"tokens/round {v[0][1]:.2f}, rows/round {v[0][2]:.1f}", flush=True)
