"""How good must an acceptance estimate be for the grow rule to pay on this pair and machine?

    python -m training.decider.ceiling --traces runs/traces-mine-heldout --decider runs/deciders

Replays the grow rule (grow_replay, decisions exactly as the engine makes them) on greedy traces
with a family of estimators that know more and more about the outcome: the draft's q with the
node's greedy match mixed into its logit,

    z = logit(q) + beta * (2 * match - 1) + beta > 0 ? N(0, noise) : 0,

each calibrated on the same rows (isotonic, in sample: as well calibrated as an estimate can be).
beta = 0 is q, calibrated; large beta is a clairvoyant. For each, the node ROC-AUC and the
replayed tokens/s; then the AUC an estimator needs to reach each of the decider's goals: 1.10x
the best fixed shape, 1.05x grow(q), half the node oracle's gain. A decider's measured AUC set
against those says whether better training could get there or the signal is missing. The family
is one model of extra information (a real decider's errors are shaped by its features): the
AUCs it gives are a guide, not a bound.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from decoding.decider.policy import RUNS_DECIDERS, resolve_decider_dir
from decoding.models.fingerprint import same_model

from training.config_flags import parse_config
from training.decider.grow_replay import grow_policy
from training.decider.metrics import roc_auc
from training.decider.replay import Q_TOKEN, CostModel, ReplaySet, baseline_table, replay
from training.decider.traces import load_traces



@dataclass
class CeilingConfig:
    traces: str = "runs/traces-mine-heldout"
    """Greedy trace dir to replay (held-out prompts; the README's held-out collect)."""
    decider: str = RUNS_DECIDERS
    """Decider: a run dir, a deciders root (its latest) or 'latest' (the shipped pair's). Its
    stored cost model prices the replay; its test ROC-AUC is marked."""
    out: str | None = None
    """Report dir (default: runs/ceiling/<decider id>)."""
    betas: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0])
    """How much of the outcome each estimator of the family knows (0 = q alone)."""
    noise: float = 1.0
    """Std of the logit noise that comes with that knowledge."""
    seed: int = 0
    max_nodes: int = 64

    def __post_init__(self):
        try:
            self.betas = sorted(float(b) for b in self.betas)  # from the command line: strings
        except ValueError:
            raise ValueError(f"--betas must be numbers (got {self.betas})") from None
        if not self.betas or self.betas[0] < 0:
            raise ValueError("--betas must be non-negative numbers")


def calibrated(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    from sklearn.isotonic import IsotonicRegression

    return IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(z, y).predict(z)


def needed_auc(aucs: list[float], tps: list[float], goal: float) -> float | None:
    """Smallest AUC whose (linearly interpolated) tokens/s reaches `goal`; None if none does."""
    for i, (a, t) in enumerate(zip(aucs, tps)):
        if t >= goal:
            if i == 0:
                return a
            a0, t0 = aucs[i - 1], tps[i - 1]
            return a0 + (a - a0) * (goal - t0) / (t - t0)
    return None


def ceiling(cfg: CeilingConfig) -> dict:
    try:
        manifest, table = load_traces(cfg.traces)
    except ValueError as e:  # the default path: name the flag that picks another
        raise ValueError(f"{e}: pass --traces DIR (held-out greedy traces from training.collect)") from None
    if float(manifest.get("collect", {}).get("temperature", 0.0)) != 0.0:
        raise ValueError(f"{cfg.traces}: traces were sampled; the ceiling replays greedy traces only")
    ddir = resolve_decider_dir(cfg.decider)
    dconf = json.loads((ddir / "config.json").read_text())
    pair, want = dconf.get("model_pair") or {}, manifest.get("model_pair") or {}
    if set(pair) != set(want) or not all(same_model(pair[r], want[r]) for r in pair):
        raise ValueError(f"decider {ddir} was trained for another model pair than {cfg.traces}: "
                         f"pass --decider DIR (the one fit on these traces' pair)")
    cm = dconf["cost_model"]
    cost = CostModel(**cm)  # the fit stores asdict(CostModel); a curve without a unit reads as nodes
    rs = ReplaySet(table)
    feats = np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float64)
    q = feats[:, Q_TOKEN]
    y = table.column("greedy_match").to_numpy(zero_copy_only=False).astype(np.float64)
    ok = rs.valid
    tab = baseline_table(rs, feats.astype(np.float32), cost)
    base, oracle = tab["best_fixed_shape"]["tokens_per_s"], tab["oracle"]["tokens_per_s"]
    widths = {"tree": None, "chain": (1,) * rs.max_depth}

    def grow(scores):
        return {e: replay(rs, grow_policy(scores, cost, cfg.max_nodes, w), cost)["tokens_per_s"]
                for e, w in widths.items()}

    grow_q = grow(q)
    rng = np.random.default_rng(cfg.seed)
    lq = np.log(np.clip(q, 1e-6, 1 - 1e-6) / (1 - np.clip(q, 1e-6, 1 - 1e-6)))
    rows = []
    for beta in cfg.betas:
        z = lq + beta * (2 * y - 1) + (rng.normal(0.0, cfg.noise, len(y)) if beta > 0 else 0.0)
        s = np.zeros(len(y))
        s[ok] = calibrated(z[ok], y[ok])
        rows.append({"beta": beta, "roc_auc": roc_auc(y[ok], z[ok]), **grow(s)})
    metrics = json.loads((ddir / "metrics.json").read_text())
    dauc = metrics.get("classification", {}).get("test", {}).get("decider", {}).get("roc_auc")
    goals = {"1.10x best fixed shape": 1.10 * base, "1.05x grow(q)": 1.05 * max(grow_q.values()),
             "half the node oracle's gain": base + 0.5 * (oracle - base)}
    aucs = [r["roc_auc"] for r in rows]
    need = {g: {e: needed_auc(aucs, [r[e] for r in rows], v) for e in widths} for g, v in goals.items()}
    return {"traces": cfg.traces, "decider": str(ddir), "decider_test_roc_auc": dauc,
            "q_roc_auc": roc_auc(y[ok], q[ok]), "rounds": rs.rounds, "cost_model": cm,
            "best_fixed_shape": {"shape": tab["best_fixed_shape"]["shape"], "tokens_per_s": base},
            "oracle_tokens_per_s": oracle, "grow_q": grow_q, "goals_tokens_per_s": goals,
            "estimators": rows, "needed_auc": need, "config": cfg.__dict__}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    aucs = [r["roc_auc"] for r in res["estimators"]]
    for env, style in (("tree", "o-"), ("chain", "s-")):
        ax.plot(aucs, [r[env] for r in res["estimators"]], style, label=f"grow, {env} envelope")
    for (g, v), c in zip(res["goals_tokens_per_s"].items(), ("tab:red", "tab:purple", "tab:gray")):
        ax.axhline(v, color=c, ls="--", lw=1, label=f"goal: {g} ({v:.1f})")
    ax.axhline(res["best_fixed_shape"]["tokens_per_s"], color="k", lw=1,
               label=f"best fixed shape {res['best_fixed_shape']['shape']}")
    for name, a in (("q", res["q_roc_auc"]), ("decider", res["decider_test_roc_auc"])):
        if a is not None:
            ax.axvline(a, color="tab:green" if name == "q" else "tab:orange", ls=":", label=f"{name} AUC {a:.3f}")
    ax.set_xlabel("node ROC-AUC of the (calibrated) acceptance estimate")
    ax.set_ylabel("replayed tokens/s")
    ax.set_title("What the grow rule gains from a better estimate (replay)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    cfg = parse_config(CeilingConfig, argv, "python -m training.decider.ceiling", __doc__.split("\n\n")[0])
    try:
        res = ceiling(cfg)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out = Path(cfg.out or Path("runs/ceiling") / Path(res["decider"]).name)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "ceiling.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, default=float))
    tmp.replace(out / "ceiling.json")
    plot(res, out / "ceiling.png")
    print(json.dumps({"out": str(out), "q_roc_auc": res["q_roc_auc"], "decider_test_roc_auc": res["decider_test_roc_auc"],
                      "best_fixed_shape": res["best_fixed_shape"], "grow_q": res["grow_q"],
                      "needed_auc": res["needed_auc"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
