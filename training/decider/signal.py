"""What else does the draft side know? Candidate-signal ablations on recorded greedy traces:
each study fits models on the training traces with the decider's features plus a group of
candidate columns and scores them by node ROC-AUC (greedy_match, valid nodes) on the held-out
traces, overall and per domain (general g-*, code humaneval-*), beside q alone:

    python -m training.decider.signal --study hidden --traces runs/traces-walkh \
        --test-traces runs/traces-walkh-heldout --out reports/decider/signal/hidden.json

- hidden: the feature head's hidden state at each node's parent (traces collected with
  `--hidden true`), reduced to 32 principal components fitted on every 5th training row;
  gradient boosting and logistic regression on the features, features + components, and the
  components alone.
- history: the path's ancestors (the parent's q_entropy, q_top1, q_token and the entropy
  trend) and the draft's first-candidate match at the 4 previous positions and their mean
  (walked traces: a round at every position); gradient boosting.
- context: feature schema 3's context columns (decoding/decider/context.py), each group added to the
  schema-2 columns; gradient boosting and logistic regression. The schema-3 choice was made
  (reports/decider/context3/ablation.json) with candidates recomputed from regenerated text on
  schema-2 traces; that one-off is in git history, this study re-checks what was kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

from decoding.decider.context import CONTEXT_NAMES, SCHEMA_CONTEXT
from decoding.decider.features import FEATURE_NAMES as FN, SCHEMA_COLUMNS
from decoding.options import add_option

from training.shards import write_json
from training.decider.metrics import roc_auc
from training.decider.traces import feature_matrix, hidden_matrix, load_traces

STUDIES = ("hidden", "history", "context")
PCA_COMPONENTS = 32
_S3 = CONTEXT_NAMES[SCHEMA_CONTEXT[2]:]  # the columns schema 3 added
CONTEXT_GROUPS = {
    "+ match lengths, what the longest says": ["match_len", "match_len_token", "longest_says"],
    "+ continuation shares": [n for n in _S3 if n.startswith("continue_share")],
    "+ log counts": ["log_last_count", "log_token_count"],
    "+ schema 3's choice": list(_S3),
}


def _col(t, name) -> np.ndarray:
    return np.asarray(t.column(name).to_pylist())


def ancestors(X, pid, rnd, node, parent) -> np.ndarray:
    """[rows, 4] the parent node's q_entropy, q_top1, q_token and this node's q_entropy minus the
    parent's (NaN at the roots)."""
    row = {k: i for i, k in enumerate(zip(pid, rnd, node))}
    pi = np.array([row.get(k, -1) for k in zip(pid, rnd, parent)])
    anc = np.where(pi[:, None] >= 0, X[np.maximum(pi, 0)][:, [FN.index(n) for n in ("q_entropy", "q_top1", "q_token")]],
                   np.nan)
    return np.hstack([anc, X[:, [FN.index("q_entropy")]] - anc[:, :1]]).astype(np.float32)


def agreement_history(X, pid, pos, y, back=4) -> np.ndarray:
    """[rows, back + 1] whether the draft's first candidate (depth 1, branch 0) matched the target
    at each of the `back` previous positions, and their mean (NaN where there was none)."""
    first = np.flatnonzero((X[:, FN.index("depth")] == 1) & (X[:, FN.index("branch")] == 0))
    seen = {(pid[i], pos[i]): float(y[i]) for i in first}
    h = np.array([[seen.get((a, p - k), np.nan) for k in range(1, back + 1)] for a, p in zip(pid, pos)],
                 dtype=np.float32).reshape(len(pid), back)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a prompt's first positions have no history
        return np.hstack([h, np.nanmean(h, 1, keepdims=True)])


def load(path, study: str) -> dict:
    """{"features", "y", "pid", and the study's candidate groups}, valid nodes only."""
    _, t = load_traces(path)
    X, y, pid = feature_matrix(t), _col(t, "greedy_match").astype(int), _col(t, "prompt_id").astype(str)
    out = {"features": X, "y": y, "pid": pid}
    if study == "hidden":
        H = hidden_matrix(t)
        if H is None:
            raise ValueError(f"{path}: the traces carry no hidden state (collect with --hidden true)")
        out["hidden"] = H
    elif study == "history":
        out["ancestors"] = ancestors(X, pid, _col(t, "round"), _col(t, "node"), _col(t, "parent"))
        out["history"] = agreement_history(X, pid, _col(t, "position"), y)
    valid = _col(t, "valid").astype(bool)
    return {k: v[valid] for k, v in out.items()}


def _scores(model: str, A, y, B) -> np.ndarray:
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    m = (HistGradientBoostingClassifier(max_iter=200, random_state=0) if model == "gradient_boosting"
         else make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)))
    return m.fit(A, y).predict_proba(B)[:, 1]


def _domains(pid) -> dict:
    d = {"all": np.ones(len(pid), bool), "general": np.char.startswith(pid, "g-"),
         "code": np.char.startswith(pid, "humaneval")}
    return {k: m for k, m in d.items() if m.any()}


def _inputs(study: str, tr: dict, te: dict) -> dict:
    """{name: (train matrix, test matrix)} the study compares."""
    F = lambda d, cols=slice(None): d["features"][:, cols]  # noqa: E731
    if study == "hidden":
        from sklearn.decomposition import PCA

        k = min(PCA_COMPONENTS, tr["hidden"].shape[1], len(tr["hidden"][::5]))
        pca = PCA(k, random_state=0).fit(tr["hidden"][::5])
        tr["pca"], te["pca"] = pca.transform(tr["hidden"]), pca.transform(te["hidden"])
        tr["explained"] = float(pca.explained_variance_ratio_.sum())
        return {"features": (F(tr), F(te)), f"features + hidden pca{k}": (np.hstack([F(tr), tr["pca"]]),
                np.hstack([F(te), te["pca"]])), f"hidden pca{k}": (tr["pca"], te["pca"])}
    if study == "history":
        sets = {"features": [], "features + ancestors": ["ancestors"], "features + history": ["history"],
                "features + ancestors + history": ["ancestors", "history"]}
        return {n: (np.hstack([F(tr)] + [tr[g] for g in gs]), np.hstack([F(te)] + [te[g] for g in gs]))
                for n, gs in sets.items()}
    s2 = list(range(SCHEMA_COLUMNS[2]))
    sets = {"schema 2 columns": [], **CONTEXT_GROUPS}
    return {n: (F(tr, s2 + [FN.index(c) for c in g]), F(te, s2 + [FN.index(c) for c in g])) for n, g in sets.items()}


def study(name: str, train, test) -> dict:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r} (one of {', '.join(STUDIES)})")
    tr, te = load(train, name), load(test, name)
    y, doms = te["y"], _domains(te["pid"])
    auc = lambda s: {d: roc_auc(y[m], s[m]) for d, m in doms.items()}  # noqa: E731
    out = {"study": name, "train": str(train), "test": str(test), "label": "greedy_match",
           "rows": {"train": int(len(tr["y"])), "test": int(len(y))},
           "auc": {"q_token": auc(te["features"][:, FN.index("q_token")])}}
    models = ("gradient_boosting",) if name == "history" else ("gradient_boosting", "logistic_regression")
    for inp, (A, B) in _inputs(name, tr, te).items():
        for model in models:
            out["auc"][f"{model}: {inp}"] = auc(_scores(model, A, tr["y"], B))
        print(inp, {k: round(v["all"], 4) for k, v in out["auc"].items() if k.endswith(": " + inp)},
              file=sys.stderr, flush=True)
    if name == "hidden":
        out["hidden_size"], out["pca_explained_variance"] = int(tr["hidden"].shape[1]), tr["explained"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.decider.signal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, choices=STUDIES)
    add_option(ap, "traces", required=True)
    ap.add_argument("--test-traces", required=True, help="held-out traces of the same pair")
    add_option(ap, "out")
    a = ap.parse_args(argv)
    try:
        res = study(a.study, a.traces, a.test_traces)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
