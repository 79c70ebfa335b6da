"""Under sampling, does it pay to value a level's children as the expected draw rather than
as the top-k candidates the engine scores today? Replayed on the T=0.7 held-out traces.

A one-off check (2026-11-26), kept beside its output (sampling_values.json):

    .venv/bin/python reports/decider/20261126-033947-c439c2/sampling_values.py

The engine sizes a level from its top-k candidates (the b-th child valued as the b-th most
likely token), then draws a sample and values what it drew. The replay (grow_replay with
`count_scores`) sizes each recorded level the same way from the parent's top-10 (in every
row's features) and keeps the recorded draws. Variants of the sizing score, for q and for this
decider (scored on features made for each candidate token): the b-th candidate (the engine
today), or the expectation over a draw (sum over the top-10 tokens of q(x) / top-10 mass times
the score of x as the b-th child). Sampled-trace replay is an estimate, not exact."""
import json, sys
from pathlib import Path

sys.path.insert(0, ".")  # run from the repository root
import numpy as np, torch

from decoding.decider import load_decider
from decoding.features import FEATURE_NAMES as FN
from training.decider.grow_replay import grow_policy
from training.decider.replay import CostModel, ReplaySet, fixed, replay
from training.decider.traces import load_traces

here = Path(__file__).parent
net, dcfg = load_decider(Path("checkpoints/deciders") / here.name)
cm = json.loads(Path("checkpoints/deciders/20261126-033710-da421d/config.json").read_text())["cost_model"]
cost = CostModel(**{k: cm[k] for k in ("sizes", "target_ms", "draft_ms", "overhead_ms", "policy_ms")}, unit=cm["unit"])
_, t = load_traces("runs/traces-eagle3c-t07-heldout")
rs = ReplaySet(t)
F = np.stack(t.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
TOP = [FN.index(f"q_top{i}") for i in range(1, 11)]
QT, RK, BR, PL = (FN.index(n) for n in ("q_token", "token_rank", "branch", "path_logq"))
score = lambda G: torch.sigmoid(net(torch.from_numpy(G), None)).double().numpy()
parent_path = F[:, PL] - np.log(np.clip(F[:, QT], 1e-30, None))


def as_candidate(rank, branch):
    """Every row's features as if its token were the parent's rank-th token, drawn as branch."""
    G = F.copy()
    tok = F[:, TOP[rank]]
    G[:, QT], G[:, RK], G[:, BR] = tok, rank, branch
    G[:, PL] = parent_path + np.log(np.clip(tok, 1e-30, None))
    return G


with torch.inference_mode():
    drawn = score(F)
    S = np.stack([np.stack([score(as_candidate(r, b)) for r in range(10)], 1) for b in range(4)], 1)
n, b = len(F), np.minimum(rs.branch, 3)
top = F[:, TOP].astype(np.float64)
w = top / top.sum(1, keepdims=True)
q = F[:, QT].astype(np.float64)
variants = {
    "q, b-th candidate (engine today)": (q, top[np.arange(n), np.minimum(rs.branch, 9)]),
    "q, expected draw": (q, (top * w).sum(1)),
    "decider, b-th candidate (engine today)": (drawn, S[np.arange(n), b, np.minimum(rs.branch, 9)]),
    "decider, expected draw": (drawn, (S[np.arange(n), b] * w).sum(1)),
}
out = {"fixed": {f"sd g{d}": replay(rs, fixed(d, 1), cost)["tokens_per_s"] for d in (1, 2, 3)}}
for env, lw in (("tree", None), ("chain", (1,) * rs.max_depth)):
    for name, (s, cs) in variants.items():
        out[f"{env}: {name}"] = replay(rs, grow_policy(s, cost, level_widths=lw, count_scores=cs), cost)
(here / "sampling_values.json").write_text(json.dumps(out, indent=1))
for k, v in out.items():
    print(k, json.dumps(v if k == "fixed" else {x: round(v[x], 2) for x in ("tokens_per_s", "mean_nodes")}))
