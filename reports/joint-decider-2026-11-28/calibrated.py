"""The joint budget with and without a learnt per-level cost (JointGrow.calibrate), the budget every
round and with the measured choice (before and after it timed a kind only after a round of its own:
OLD=path/to/old/decoding/batch/measured.py adds the old one), over q; batched `ar` beside them. The
serve workload in process (16 held-out chat prompts, N slots, greedy, 96 new tokens). Modes in turn,
3 turns, one process: `[OLD=...] python calibrated.py [clients ...]`."""
import importlib.util, os, sys, torch
torch.set_num_threads(2)
from decoding.batch.budget import JointGrow
from decoding.batch.measured import MeasuredChoice
from decoding.batch.scheduler import BatchEngine
from decoding.growth import q_scores
from workload import in_turn, loaded, serve_workload

clients = [int(c) for c in sys.argv[1:]] or [1, 4]
dec, s, cfg, ids, eos, layout, cost = loaded()


def joint(calibrate=False, measured=None):
    return lambda: BatchEngine(s.target, s.draft, layout, budget=JointGrow(
        q_scores, cost, max_width=cfg.width, max_nodes=cfg.max_nodes, calibrate=calibrate),
        measured=measured() if measured else None)


modes = {"always q": joint(), "always q calibrated": joint(calibrate=True),
         "measured q": joint(measured=MeasuredChoice),
         "measured q calibrated": joint(calibrate=True, measured=MeasuredChoice),
         "ar batched": lambda: BatchEngine(s.target, None)}
if os.environ.get("OLD"):
    spec = importlib.util.spec_from_file_location("old_measured", os.environ["OLD"])
    old = sys.modules["old_measured"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    modes["measured q, old choice"] = joint(measured=old.MeasuredChoice)


def run(make, n):
    tps, tokens = serve_workload(e := make(), ids, n, eos)
    lm = e.budget.level_ms if e.budget is not None else 0.0
    return tps, tokens / e.rounds, sum(e.verify_rows) / e.rounds, lm


run(modes["always q"], 1)  # warm-up
in_turn(modes, run, clients, lambda x: f"tokens/round {x[1]:.2f}, rows/round {x[2]:.1f}, level_ms at the end {x[3]:.2f}")
