"""How much text does the feature head need? Validation step-1 agreement against positions seen.

    python -m training.head.scaling \
        --curve "target-written corpus" reports/draft/feature/eval_80min.json \
            reports/draft/feature/eval_170min.json reports/draft/feature/eval_250min.json \
        --curve "both older corpora, warm start" reports/draft/feature/eval.json \
        --curve "with corpus-scale, warm start" runs/distill/smollm2-135m-eagle3-chunks/version_0/metrics.csv \
        --positions-per-step 1940 --chain --out reports/head-scaling

A curve is one training run: its validation points read from a bench JSON's `learning_curve`
(training.bench.head) or a Lightning metrics.csv, merged by step. Positions seen =
steps x the run's mean positions a step: metrics.csv logs them (`train/positions`); a bench JSON
does not, so `--positions-per-step` stands in for it and the output says so. With `--chain`
each curve starts where the one before ended (each run warm-started from the one before).
Writes <out>/scaling.png (overall, general and code) and <out>/scaling.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from decoding.options import add_option

KINDS = ("", "_general", "_code")


def read_points(path: Path) -> tuple[list[dict], float | None]:
    """(validation points {step, agree, agree_general, agree_code}, mean positions a step or None)."""
    if path.suffix == ".csv":
        with path.open() as f:
            rows = list(csv.DictReader(f))
        pos = [float(r["train/positions"]) for r in rows if r.get("train/positions")]
        vals = [r for r in rows if r.get("val/agree_1")]
        per = sum(pos) / len(pos) if pos else None
    else:
        vals, per = json.loads(path.read_text()).get("learning_curve") or [], None
    return [{"step": int(float(r["step"])), **{f"agree{k}": float(r[f"val/agree_1{k}"]) for k in KINDS
                                                 if r.get(f"val/agree_1{k}") not in (None, "")}}
            for r in vals], per


def curve(label: str, paths: list[str], default_per_step: float | None) -> dict:
    points, pers = {}, []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SystemExit(f"error: {p}: no such file")
        got, per = read_points(path)
        points.update({q["step"]: q for q in got})
        pers.append(per)
    if not points:
        raise SystemExit(f"error: curve {label!r}: no validation points in {', '.join(paths)}")
    known = [p for p in pers if p]
    per = sum(known) / len(known) if known else default_per_step
    if not per:
        raise SystemExit(f"error: curve {label!r} logs no positions: give --positions-per-step")
    return {"label": label, "files": paths, "positions_per_step": per,
            "positions_measured": bool(known), "points": [points[s] for s in sorted(points)]}


def place(curves: list[dict], chain: bool) -> None:
    """x = positions seen; chained curves start where the previous one's last point was."""
    start = 0.0
    for c in curves:
        c["offset"] = start if chain else 0.0
        for q in c["points"]:
            q["positions"] = c["offset"] + (q["step"] + 1) * c["positions_per_step"]
        start = c["points"][-1]["positions"]


def plot(curves: list[dict], png: Path, goal: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, kind, title in zip(axes, KINDS, ("all", "general", "code")):
        for c in curves:
            pts = [q for q in c["points"] if f"agree{kind}" in q]
            style = "-o" if c["positions_measured"] else "--o"
            ax.plot([q["positions"] / 1e6 for q in pts], [q[f"agree{kind}"] for q in pts], style, ms=3,
                    label=c["label"])
            if c["offset"]:
                ax.axvline(c["offset"] / 1e6, c="grey", lw=0.6, ls=":")
        ax.axhline(goal, c="grey", ls=":", lw=1)
        ax.set_title(f"validation step-1 agreement: {title}")
        ax.set_xlabel("positions seen (millions)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with the target")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--curve", nargs="+", action="append", required=True, metavar=("LABEL", "FILE"),
                   help="a run's label, then its bench JSONs or metrics.csv")
    p.add_argument("--positions-per-step", type=float, default=None,
                   help="positions a step for curves whose files do not log them")
    p.add_argument("--chain", action="store_true", help="each curve continues the one before")
    p.add_argument("--goal", type=float, default=0.72, help="the agreement goal drawn as a line")
    add_option(p, "out", default="reports/head-scaling")
    a = p.parse_args(argv)
    if any(len(c) < 2 for c in a.curve):
        raise SystemExit("error: --curve wants a label and at least one file")
    curves = [curve(c[0], c[1:], a.positions_per_step) for c in a.curve]
    place(curves, a.chain)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, out / "scaling.png", a.goal)
    doc = {"chain": a.chain, "goal": a.goal, "curves": curves}
    tmp = out / "scaling.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "scaling.json")
    for c in curves:
        last, best = c["points"][-1], max(c["points"], key=lambda q: q.get("agree", -math.inf))
        src = "logged" if c["positions_measured"] else "given"
        print(f"{c['label']}: {len(c['points'])} points, {c['offset'] / 1e6:.2f}M -> {last['positions'] / 1e6:.2f}M "
              f"positions ({c['positions_per_step']:.0f} a step, {src}); last {last.get('agree', math.nan):.3f}, "
              f"best {best.get('agree', math.nan):.3f}")


if __name__ == "__main__":
    main()
