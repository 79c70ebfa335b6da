"""Do the path's ancestors or the recent agreement history carry acceptance signal beyond the
schema-3 features? The one-off ablation (2026-11-26), kept beside its output (path_history.json):

    .venv/bin/python reports/decider/signal/path_history.py runs/traces-walk runs/traces-walk-heldout

The traces are the walked greedy float32 traces of the default pair (a round at every position,
W4 D8, 96 new tokens; 64 val prompts / the 48 held-out bench prompts; decider
20261126-091631-f8ab83's). Candidate columns, all known before the round is verified:
- ancestors: the parent node's own q_entropy, q_top1 and q_token (its parent's distribution and
  how the draft rated the parent), and the entropy trend (this node's parent entropy minus the
  grandparent's), as issue 13 names them ("sibling and ancestor scores, entropy trend");
- history: whether the draft's first candidate matched the target at each of the 4 previous
  positions, and their mean (the walk has a round at every position, so these do not depend on
  any policy).
Gradient boosting on the 29 features plus each group, fitted on the training traces, scored by
node ROC-AUC (greedy_match) on the held-out traces, overall and per domain."""
import json, sys, warnings
from pathlib import Path
sys.path.insert(0, ".")  # run from the repository root
import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from decoding.features import FEATURE_NAMES as FN
from training.decider.traces import feature_matrix, load_traces


def load(path):
    _, t = load_traces(path)
    X = feature_matrix(t)
    col = lambda c: np.array(t.column(c).to_pylist())  # noqa: E731
    pid, rnd, node, par, pos, y = (col(c) for c in ("prompt_id", "round", "node", "parent", "position", "greedy_match"))
    row = {k: i for i, k in enumerate(zip(pid, rnd, node))}
    pi = np.array([row.get(k, -1) for k in zip(pid, rnd, par)])
    anc = np.where(pi[:, None] >= 0, X[np.maximum(pi, 0)][:, [FN.index(n) for n in ("q_entropy", "q_top1", "q_token")]], np.nan)
    trend = X[:, [FN.index("q_entropy")]] - anc[:, :1]
    first = {(pid[i], pos[i]): y[i] for i in np.where((X[:, FN.index("depth")] == 1) & (X[:, FN.index("branch")] == 0))[0]}
    hist = np.array([[first.get((a, p - k), np.nan) for k in (1, 2, 3, 4)] for a, p in zip(pid, pos)], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a prompt's first positions have no history
        hist = np.hstack([hist, np.nanmean(hist, 1, keepdims=True)])
    return {"features": X, "ancestors": np.hstack([anc, trend]), "history": hist}, y, pid


def main(train_dir, test_dir):
    tr, ytr, _ = load(train_dir)
    te, yte, pid = load(test_dir)
    doms = {"all": np.ones(len(yte), bool), "general": np.char.startswith(pid.astype(str), "g-")}
    doms["code"] = ~doms["general"]
    out = {"rows": {"train": int(len(ytr)), "test": int(len(yte))}, "auc": {}}
    for name, groups in (("features", ["features"]), ("features + ancestors", ["features", "ancestors"]),
                         ("features + history", ["features", "history"]),
                         ("features + ancestors + history", ["features", "ancestors", "history"])):
        gb = HistGradientBoostingClassifier(max_iter=200, random_state=0)
        gb.fit(np.hstack([tr[g] for g in groups]), ytr)
        s = gb.predict_proba(np.hstack([te[g] for g in groups]))[:, 1]
        out["auc"][f"gradient_boosting: {name}"] = {d: float(roc_auc_score(yte[m], s[m])) for d, m in doms.items()}
        print(name, {d: round(v, 4) for d, v in out["auc"][f"gradient_boosting: {name}"].items()}, flush=True)
    Path(__file__).with_name("path_history.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
