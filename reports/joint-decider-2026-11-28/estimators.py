"""The joint budget's estimate, in process on the serve suite's workload (16 held-out chat prompts,
N slots each taking its next prompt when a request ends, greedy, 96 new tokens; no HTTP): q, the
registry's latest decider, and a decider fitted on the joint budget's own rounds, the budget every
round (`joint-always`); batched `ar` beside them. Modes in turn, 3 turns, one process:

    python reports/joint-decider-2026-11-28/estimators.py RUN_ID [clients ...]
"""
import sys, torch
torch.set_num_threads(2)
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.growth import q_scores
from workload import in_turn, loaded, serve_workload

run_id, clients = sys.argv[1], [int(c) for c in sys.argv[2:]] or [1, 4]
dec, s, cfg, ids, eos, layout, cost = loaded()


def joint(scorer, label="q", needs_hidden=False):
    return lambda: BatchEngine(s.target, s.draft, layout, budget=JointGrow(
        scorer, cost, max_width=cfg.width, max_nodes=cfg.max_nodes, label=label, needs_hidden=needs_hidden))


def decider(name):
    g = s.decider_stop(name, "grow", None, cfg)
    return joint(g.scorer, "decider", g.needs_hidden)


modes = {"q": joint(q_scores), "latest decider": decider(None), f"joint-fitted {run_id}": decider(f"checkpoints/deciders/{run_id}"),
         "ar batched": lambda: BatchEngine(s.target, None)}


def run(make, n):
    tps, tokens = serve_workload(e := make(), ids, n, eos)
    return tps, tokens / e.rounds, sum(e.verify_rows) / e.rounds


run(modes["q"], 1)  # warm-up
in_turn(modes, run, clients, lambda x: f"tokens/round {x[1]:.2f}, rows/round {x[2]:.1f}")
