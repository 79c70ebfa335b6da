"""How much data does draft alignment need? Best validation agreement vs training tokens.

    python -m training.draft.scaling --run runs/distill/scale-25:956 --run runs/distill/scale-50:1912 \
        --run runs/distill/smollm2-135m-draft:all --out reports/draft

Each run is a distillation of the same draft on the first ROWS training rows of the corpus
(`data.max_rows`; `all` = the whole corpus), validated on the same rows. The report fits
agreement = a + b * ln(tokens) through the runs' best points and says how many target tokens
that trend needs for the 0.6 target: an extrapolation, printed as one.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from decoding.options import add_option

from training.draft.data import is_val


def training_tokens(corpus: Path, rows: int | None, val_percent: float) -> int:
    """Completion tokens of the first `rows` training rows (the order CorpusDataModule reads)."""
    import pyarrow.parquet as pq

    from training.corpus.teacher import read_manifest

    m = read_manifest(corpus)
    if m is None:
        raise SystemExit(f"error: {corpus} is not a corpus directory")
    seen = tokens = 0
    for s in m["shards"]:
        t = pq.read_table(corpus / s["file"], columns=["prompt_id", "completion_ids"]).to_pydict()
        for pid, comp in zip(t["prompt_id"], t["completion_ids"]):
            if is_val(pid, val_percent):
                continue
            if rows is not None and seen >= rows:
                return tokens
            seen += 1
            tokens += len(comp)
    return tokens


def best_point(run: Path) -> dict:
    import pandas as pd

    csvs = sorted(run.glob("version_*/metrics.csv"))
    if not csvs:
        raise SystemExit(f"error: no metrics.csv under {run}")
    df = pd.read_csv(csvs[-1])
    v = df[df["val/agree"].notna()]
    if v.empty:
        raise SystemExit(f"error: {run} logged no validation agreement yet")
    best = v.loc[v["val/agree"].idxmax()]
    return {"best_agree": float(best["val/agree"]), "at_step": int(best["step"]),
            "last_step": int(v["step"].max()), "val_points": len(v)}


def fit_trend(points: list[dict], goal: float) -> dict:
    x = np.log([p["tokens"] for p in points])
    y = np.array([p["best_agree"] for p in points])
    b, a = np.polyfit(x, y, 1)
    need = math.exp((goal - a) / b) if b > 0 else float("inf")
    return {"a": float(a), "b_per_ln_tokens": float(b), "goal": goal, "tokens_for_goal": need}


def plot(points: list[dict], trend: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["tokens"] for p in points]
    ax.plot(xs, [p["best_agree"] for p in points], "o", label="best validation agreement")
    grid = np.geomspace(min(xs) / 1.5, max(max(xs) * 1.5, min(trend["tokens_for_goal"], 1e8)), 50)
    ax.plot(grid, trend["a"] + trend["b_per_ln_tokens"] * np.log(grid), "--", lw=1,
            label="a + b ln(tokens) (extrapolated)")
    ax.axhline(trend["goal"], ls=":", c="grey", label=f"target {trend['goal']}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (target-written completions)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", required=True, help="RUN_DIR:ROWS (ROWS = all for the whole corpus)")
    add_option(p, "corpus", default="data/corpus")
    add_option(p, "val_percent")
    p.add_argument("--goal", type=float, default=0.6)
    add_option(p, "out", default="reports/draft")
    a = p.parse_args(argv)
    points = []
    for spec in a.run:
        run, _, rows = spec.rpartition(":")
        if not run:
            raise SystemExit(f"error: --run wants RUN_DIR:ROWS (got {spec!r})")
        n = None if rows == "all" else int(rows)
        points.append({"run": run, "rows": n, **best_point(Path(run)),
                       "tokens": training_tokens(Path(a.corpus), n, a.val_percent)})
    points.sort(key=lambda q: q["tokens"])
    trend = fit_trend(points, a.goal) if len(points) >= 2 else {}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if trend:
        plot(points, trend, out / "data_scaling.png")
    (out / "data_scaling.json").write_text(json.dumps({"points": points, "trend": trend}, indent=1))
    for q in points:
        print(f"{q['tokens']:>9,d} tokens ({q['rows'] or 'all'} rows): best agreement {q['best_agree']:.4f} "
              f"at step {q['at_step']} of {q['last_step']}  [{q['run']}]")
    if trend:
        print(f"trend: agreement = {trend['a']:.3f} + {trend['b_per_ln_tokens']:.4f} ln(tokens); "
              f"{trend['goal']} needs ~{trend['tokens_for_goal']:,.0f} tokens (extrapolation)")


if __name__ == "__main__":
    main()
