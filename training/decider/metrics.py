"""Classification metrics for deciders, scikit-learn baselines, and ROC / reliability plots.

All metrics score predicted acceptance probabilities against a HARD 0/1 target (the
datamodule's `eval_target`: greedy_match for greedy traces, else `accepted` on rows whose
parent was accepted), whatever label the model was trained on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ECE_BINS = 15


def _two_classes(y: np.ndarray) -> bool:
    return len(y) > 0 and 0 < y.sum() < len(y)


def roc_auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if _two_classes(y) else float("nan")


def pr_auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(y, p)) if _two_classes(y) else float("nan")


def brier(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean((p - y) ** 2)) if len(y) else float("nan")


def reliability(y: np.ndarray, p: np.ndarray, bins: int = ECE_BINS):
    """Per equal-width bin: mean prediction, observed positive rate, count."""
    idx = np.clip((p * bins).astype(int), 0, bins - 1)
    count = np.bincount(idx, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        conf = np.bincount(idx, weights=p, minlength=bins) / count
        freq = np.bincount(idx, weights=y, minlength=bins) / count
    return conf, freq, count


def ece(y: np.ndarray, p: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: count-weighted |confidence - frequency| over 15 bins."""
    if not len(y):
        return float("nan")
    conf, freq, count = reliability(y, p, bins)
    ok = count > 0
    return float(np.sum(count[ok] * np.abs(conf[ok] - freq[ok])) / count.sum())


def classification(y: np.ndarray, p: np.ndarray) -> dict:
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    return {"roc_auc": roc_auc(y, p), "pr_auc": pr_auc(y, p), "brier": brier(y, p),
            "ece": ece(y, p), "n": len(y), "positive_rate": float(y.mean()) if len(y) else float("nan")}


# --- scikit-learn baselines, fitted on the same train split --------------------------------
def _soft_fit_set(x: np.ndarray, label: np.ndarray):
    """BCE on soft labels == weighted log-loss on each row as a positive (weight y) and a
    negative (weight 1 - y): lets classifiers that need 0/1 classes train on min(1, p/q)."""
    y = np.concatenate([np.ones(len(x)), np.zeros(len(x))])
    w = np.concatenate([label, 1.0 - label])
    keep = w > 0
    return np.concatenate([x, x])[keep], y[keep], w[keep]


def fit_baselines(x: np.ndarray, label: np.ndarray, max_rows: int = 200_000, seed: int = 0) -> dict:
    """{name: fitted classifier} for LogisticRegression and HistGradientBoostingClassifier."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if len(x) > max_rows:  # keeps baseline fitting to seconds on big trace sets
        keep = np.random.default_rng(seed).choice(len(x), max_rows, replace=False)
        x, label = x[keep], label[keep]
    xs, ys, ws = _soft_fit_set(x, label.astype(np.float64))
    if len(np.unique(ys)) < 2:
        return {}
    lr = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    lr.fit(xs, ys, logisticregression__sample_weight=ws)
    hgb = HistGradientBoostingClassifier(max_iter=200, random_state=seed)
    hgb.fit(xs, ys, sample_weight=ws)
    return {"logistic_regression": lr, "hist_gradient_boosting": hgb}


def predict(model, x: np.ndarray) -> np.ndarray:
    return model.predict_proba(x)[:, 1].astype(np.float64)


def feature_ablation(x_tr: np.ndarray, label_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray,
                     groups: dict[str, list[int]], max_rows: int = 200_000, seed: int = 0) -> dict:
    """Which features carry signal: test ROC-AUC of a logistic regression (the same soft-label
    fit as the baselines) on ALL features, on each group ALONE and on all features WITHOUT each
    group. A group whose removal costs nothing is redundant with the rest."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if len(x_tr) > max_rows:
        keep = np.random.default_rng(seed).choice(len(x_tr), max_rows, replace=False)
        x_tr, label_tr = x_tr[keep], label_tr[keep]
    xs, ys, ws = _soft_fit_set(x_tr, label_tr.astype(np.float64))
    if len(np.unique(ys)) < 2 or not _two_classes(y_te):
        return {}

    def auc(cols: list[int]) -> float:
        lr = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        lr.fit(xs[:, cols], ys, logisticregression__sample_weight=ws)
        return roc_auc(y_te, predict(lr, x_te[:, cols]))

    every = sorted(c for cols in groups.values() for c in cols)
    out = {"all": {"roc_auc": auc(every)}}
    for name, cols in groups.items():
        rest = [c for c in every if c not in cols]
        out[name] = {"alone": auc(cols), "without": auc(rest) if rest else float("nan")}
    return out


# --- plots -----------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str) -> Path:
    from sklearn.metrics import roc_curve

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    for name, (y, p) in curves.items():
        if _two_classes(y):
            fpr, tpr, _ = roc_curve(y, p)
            ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc(y, p):.3f})")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_calibration(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    for name, (y, p) in curves.items():
        conf, freq, count = reliability(y, p)
        ok = count > 0
        ax.plot(conf[ok], freq[ok], marker="o", ms=3, label=f"{name} (ECE {ece(y, p):.3f})")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.set(xlabel="predicted acceptance probability", ylabel="observed acceptance rate",
           xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(rows: dict[str, dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.4f}" if isinstance(v, float) else "n/a" if v is None else str(v)

    lines = ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for name, r in rows.items()]
    return "\n".join(lines)
