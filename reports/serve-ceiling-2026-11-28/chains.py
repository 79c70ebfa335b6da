"""Fixed chains against the default, in process (the serve suite's workload): `sd` with gamma 2 / 3 /
4, each request drafting its own chain every round (--budget independent), and the default joint
budget; 1 and 4 clients, modes in turn, 2 turns. `python chains.py`: median tok/s (each turn's)."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "joint-decider-2026-11-28"))
from workload import loaded, serve_workload  # noqa: E402

from decoding import Decoder  # noqa: E402
from decoding.serve.__main__ import batch_engine  # noqa: E402

torch.set_num_threads(2)
dec, s, cfg, ids, eos, layout, cost = loaded()
decs = {"default joint": (dec, "joint")}
for g in (2, 3, 4):
    decs[f"sd gamma {g}"] = (Decoder.load(strategy="sd", gamma=g), "independent")
for n in (1, 4):
    res = {k: [] for k in decs}
    for k, (d, b) in decs.items():  # warm-up
        serve_workload(batch_engine(d, b), ids[:2], 1, eos)
    for _ in range(2):
        for k, (d, b) in decs.items():
            res[k].append(serve_workload(batch_engine(d, b), ids, n, eos)[0])
    for k, v in res.items():
        print(f"clients {n} {k:<16} {statistics.median(v):6.1f} ({' '.join(f'{x:.0f}' for x in v)})", flush=True)
