"""Does the feature draft's hidden state carry acceptance signal beyond the schema-3 features?
The one-off ablation (2026-11-26) behind the hybrid decider 20261126-105338-2718b5, kept beside
its output (hidden.json):

    .venv/bin/python reports/decider/signal/hidden.py runs/traces-walkh runs/traces-walkh-heldout

The traces are the walked greedy float32 traces of the default pair (every position, W4 D8, 96
new tokens; 64 val prompts / the 48 held-out bench prompts) collected with `--hidden true`: each
node carries the head's normed hidden state at its parent (576 values: what produced q, and
what reads the target's features). The hidden state is reduced to 32 principal components
(fitted on every 5th training row). A logistic regression and gradient boosting are fitted on
the training traces with the 29 features, the features plus the components, and the components
alone, and scored by node ROC-AUC (greedy_match, valid nodes) on the held-out traces, overall
and per domain (general g-*, code humaneval-*)."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, ".")  # run from the repository root
import numpy as np
from sklearn.decomposition import PCA
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler
from training.decider.traces import feature_matrix, hidden_matrix, load_traces
from decoding.features import FEATURE_NAMES


def load(path):
    _, t = load_traces(path)
    valid = np.array(t.column("valid").to_pylist()) if "valid" in t.column_names else np.ones(t.num_rows, bool)
    pid = np.array(t.column("prompt_id").to_pylist())
    return (feature_matrix(t)[valid], hidden_matrix(t)[valid],
            np.array(t.column("greedy_match").to_pylist())[valid], pid[valid])


def main(train_dir, test_dir):
    Xtr, Htr, ytr, _ = load(train_dir)
    Xte, Hte, yte, pid = load(test_dir)
    pca = PCA(32, random_state=0).fit(Htr[::5])
    Ptr, Pte = pca.transform(Htr), pca.transform(Hte)
    domains = {"all": np.ones(len(yte), bool), "general": np.char.startswith(pid.astype(str), "g-"),
               "code": np.char.startswith(pid.astype(str), "humaneval")}
    q = Xte[:, FEATURE_NAMES.index("q_token")]
    out = {"rows": {"train": int(len(ytr)), "test": int(len(yte))}, "hidden_size": int(Htr.shape[1]),
           "pca_explained_variance": float(pca.explained_variance_ratio_.sum()),
           "auc": {"q_token": {d: float(roc_auc_score(yte[m], q[m])) for d, m in domains.items()}}}
    for name, A, B in (("features", Xtr, Xte), ("features + hidden pca32", np.hstack([Xtr, Ptr]), np.hstack([Xte, Pte])),
                       ("hidden pca32", Ptr, Pte)):
        t = time.time()
        gb = HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(A, ytr)
        sc = StandardScaler().fit(A)
        lr = LogisticRegression(max_iter=500).fit(sc.transform(A), ytr)
        for model, s in (("gradient_boosting", gb.predict_proba(B)[:, 1]), ("logistic_regression", lr.predict_proba(sc.transform(B))[:, 1])):
            out["auc"][f"{model}: {name}"] = {d: float(roc_auc_score(yte[m], s[m])) for d, m in domains.items()}
        print(name, {k: round(v["all"], 4) for k, v in out["auc"].items() if k.endswith(": " + name)},
              f"{time.time() - t:.0f} s", flush=True)
    Path(__file__).with_name("hidden.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
