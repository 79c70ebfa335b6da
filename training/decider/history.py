"""Does the round history carry signal that the decider's features lack? A candidate-feature
ablation on recorded traces, run before such features are added to decoding/decider/features.py (a
schema bump refits every decider):

    python -m training.decider.history --traces runs/traces-eagle3c --test runs/traces-eagle3c-heldout \
        [--out reports/decider/history.json]

History per round, from what is already committed when the round is drafted (so using it
would stay lossless): the previous round's accepted length, the mean over the last 3 rounds
and over every earlier round of the request, and a first-round flag. A logistic regression
(standardised inputs) is fitted on the training traces with and without these columns and
scored by node ROC-AUC on the test traces. The label is greedy_match, on valid nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from decoding.decider.features import FEATURE_NAMES
from decoding.options import add_option

from training.decider.traces import feature_matrix, load_traces

HISTORY = ("prev_accepted", "mean_last3", "mean_all_before", "first_round")


def round_history(prompt_ids: np.ndarray, rounds: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """[rows, 4] history of each row's round within its prompt (see HISTORY); rows may come in
    any order, several per round."""
    out = np.zeros((len(rounds), len(HISTORY)), dtype=np.float32)
    for pid in np.unique(prompt_ids):
        rows = np.flatnonzero(prompt_ids == pid)
        per_round: dict[int, float] = {}
        for r, a in zip(rounds[rows], accepted[rows]):
            per_round[int(r)] = float(a)
        seq = [per_round[r] for r in sorted(per_round)]
        index = {r: i for i, r in enumerate(sorted(per_round))}
        for row in rows:
            before = seq[:index[int(rounds[row])]]
            out[row] = ([before[-1], np.mean(before[-3:]), np.mean(before), 0.0] if before
                        else [0.0, 0.0, 0.0, 1.0])
    return out


def _arrays(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _, t = load_traces(path)
    valid = t.column("valid").to_numpy(zero_copy_only=False).astype(bool)
    hist = round_history(np.asarray(t.column("prompt_id").to_pylist()), t.column("round").to_numpy(),
                         t.column("round_accepted").to_numpy())
    y = t.column("greedy_match").to_numpy(zero_copy_only=False).astype(int)
    return feature_matrix(t)[valid], hist[valid], y[valid]


def ablation(train, test) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    (xa, ha, ya), (xb, hb, yb) = _arrays(train), _arrays(test)
    q = FEATURE_NAMES.index("q_token")

    def auc(a, b) -> float:
        m = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(a, ya)
        return float(roc_auc_score(yb, m.predict_proba(b)[:, 1]))

    return {"train": str(train), "test": str(test), "train_nodes": int(len(ya)), "test_nodes": int(len(yb)),
            "label": "greedy_match", "history_columns": list(HISTORY),
            "roc_auc": {"q_token alone": float(roc_auc_score(yb, xb[:, q])),
                        "decider features": auc(xa, xb),
                        "decider features + history": auc(np.hstack([xa, ha]), np.hstack([xb, hb])),
                        "q_token + history": auc(np.hstack([xa[:, [q]], ha]), np.hstack([xb[:, [q]], hb]))}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.decider.history", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "traces", required=True)
    ap.add_argument("--test", required=True, help="held-out traces of the same pair")
    add_option(ap, "out")
    a = ap.parse_args(argv)
    try:
        res = ablation(a.traces, a.test)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=1)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
