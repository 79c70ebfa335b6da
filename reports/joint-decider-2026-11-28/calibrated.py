"""The joint budget with and without a learnt per-level cost (JointGrow.calibrate), the budget every
round and with the measured choice (before and after it timed a kind only after a round of its own:
OLD=path/to/old/decoding/batch/measured.py adds the old one), over q; batched `ar` beside them. The
serve workload in process (16 held-out chat prompts, N slots, greedy, 96 new tokens). Modes in turn,
3 turns, one process: `[OLD=...] python calibrated.py [clients ...]`."""
import importlib.util, os, statistics, sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.batch.budget import JointGrow
from decoding.batch.measured import MeasuredChoice
from decoding.batch.scheduler import BatchEngine
from decoding.bench.serve_suite import held_out
from decoding.growth import q_scores
from decoding.tree import layout_from_k_config

clients = [int(c) for c in sys.argv[1:]] or [1, 4]
dec = Decoder.load()
s, cfg = dec.session, dec.config
ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
eos = s.eos_token_id
layout = layout_from_k_config(cfg.k_levels)
cost = s.measured_cost()


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
    lm = e.budget.level_ms if e.budget is not None else 0.0
    return tokens / wall, tokens / e.rounds, sum(e.verify_rows) / e.rounds, lm


run(modes["always q"], 1)  # warm-up
for n in clients:
    res = {m: [] for m in modes}
    for turn in range(3):
        for m, make in modes.items():
            res[m].append(run(make, n))
    for m, v in res.items():
        tps = [x[0] for x in v]
        print(f"clients {n} {m:<28} {statistics.median(tps):6.1f} tok/s ({' '.join(f'{x:.0f}' for x in tps)}), "
              f"tokens/round {v[0][1]:.2f}, rows/round {v[0][2]:.1f}, level_ms at the end {v[0][3]:.2f}", flush=True)
