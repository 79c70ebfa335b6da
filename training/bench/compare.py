"""Reading training.bench.head results: paired comparison of two heads' eval files, and plots.

    python -m training.bench.compare NEW.json BASE.json [--out DIR] [--name NAME]

Both files from `training.bench.head` on the same prompts (per-prompt counts kept):
writes <out>/<name>.json (each head's headline figures per prompt set both measured, and their
paired differences with 95% CIs, bootstrap over prompts) and <out>/<name>.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from decoding.options import add_option

from training.bench.head import HEADLINE, baseline, bootstrap
from training.shards import write_text


def compare(new: dict, base: dict) -> dict:
    """Per prompt set both have: each head's headline figures and their paired differences."""
    out = {}
    for kind in [k for k in new if k in base]:
        out[kind] = {"eval": {k: new[kind].get(k) for k in HEADLINE}, "base": {k: base[kind].get(k) for k in HEADLINE},
                     "difference_ci95": bootstrap(new[kind], base[kind])}
    if not out:
        raise ValueError("the two results share no prompt set")
    return out


def difference_plot(res: dict, png: Path) -> None:
    """Paired differences (eval - base) of each headline figure per prompt set, with 95% CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k, v in res.items() if isinstance(v, dict)]
    fig, axes = plt.subplots(1, len(HEADLINE), figsize=(3 * len(HEADLINE), 3.2))
    for ax, h in zip(axes, HEADLINE):
        got = [(k, res[k]["difference_ci95"][h]) for k in kinds if h in res[k]["difference_ci95"]]
        ax.bar(range(len(got)), [v[0] for _, v in got], color="tab:blue",
               yerr=[[v[0] - v[1] for _, v in got], [v[2] - v[0] for _, v in got]], capsize=4)
        ax.set_xticks(range(len(got)), [k for k, _ in got])
        ax.axhline(0, c="grey", lw=1)
        ax.set_title(h, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{Path(res['eval']).stem} - {Path(res['base']).stem} (paired, 95% CI over prompts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m training.bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("eval", help="training.bench.head json of the new head")
    p.add_argument("base", help="training.bench.head json of the head to compare with (same prompts)")
    add_option(p, "out", default="reports/draft/feature")
    add_option(p, "name", default="compare")
    a = p.parse_args(argv)
    a.compare = [a.eval, a.base]
    try:
        res = {"eval": a.compare[0], "base": a.compare[1]} | compare(baseline(a.compare[0]), baseline(a.compare[1]))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {str(e).splitlines()[0]}") from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"{a.name}.json", json.dumps(res, indent=1) + "\n")
    difference_plot(res, out / f"{a.name}.png")
    for kind, r in res.items():
        if isinstance(r, dict):
            print(f"{kind}: " + ", ".join(f"{k} {v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"
                                          for k, v in r["difference_ci95"].items()), file=sys.stderr)
    print(out / f"{a.name}.json")


if __name__ == "__main__":
    main()
