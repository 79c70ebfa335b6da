"""The benchmark's PNG plots, drawn from results.json: speedups with their intervals, accepted
lengths, tokens/s against tree size (the fixed-depth sweep, and every row's mean tree size)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from decoding.bench.oracle import LABEL
from decoding.bench.report import finite, ok_rows


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    conds = results["conditions"]
    names = [r["name"] for r in conds[0]["rows"] if r["name"] != "ar"]
    names += [LABEL] if any(r["name"] == LABEL for c in conds for r in c["rows"]) and LABEL not in names else []
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(names)), 4.5))
    w = 0.8 / len(conds)
    for j, cond in enumerate(conds):
        rows = {r["name"]: r for r in ok_rows(cond)}
        xs, ys, lo, hi = [], [], [], []
        for i, n in enumerate(names):
            if n in rows and rows[n].get("speedup"):
                s = rows[n]["speedup"]
                ci = [c if finite(c) else s["median"] for c in s.get("ci95") or [None, None]]
                xs.append(i + (j - (len(conds) - 1) / 2) * w)  # (the bound row has no interval)
                ys.append(s["median"])
                lo.append(s["median"] - ci[0])
                hi.append(ci[1] - s["median"])
        ax.bar(xs, ys, w, yerr=[lo, hi], capsize=2, label=cond["name"])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs ar (median; bars: 95% CI over prompts)", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, out / "speedup.png")
    plt.close(fig)

    eng = [n for n in names if any(r["name"] == n and r["kind"] == "engine" for c in conds for r in ok_rows(c))]
    cols = min(4, max(1, len(eng)))
    rws = max(1, math.ceil(len(eng) / cols))
    fig, axes = plt.subplots(rws, cols, figsize=(3.3 * cols, 2.6 * rws), squeeze=False)
    for ax, n in zip(axes.flat, eng):
        for j, cond in enumerate(conds):
            r = next((r for r in ok_rows(cond) if r["name"] == n), None)
            if not r or not r.get("accepted_lengths"):
                continue
            h = {int(k): v for k, v in r["accepted_lengths"].items()}
            tot = sum(h.values())
            ks = sorted(h)
            ax.bar([k + (j - (len(conds) - 1) / 2) * w for k in ks], [h[k] / tot for k in ks], w, label=cond["name"])
        ax.set_title(n, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("accepted draft tokens per round", fontsize=7)
    for ax in list(axes.flat)[len(eng):]:
        ax.axis("off")
    if eng:
        axes.flat[0].legend(fontsize=6)
        axes.flat[0].set_ylabel("share of rounds", fontsize=7)
    fig.tight_layout()
    _save(fig, out / "accepted_lengths.png")
    plt.close(fig)

    files = ["speedup.png", "accepted_lengths.png"]
    sw = results.get("sweep")
    if sw and sw["points"]:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for fam in sorted({p["family"] for p in sw["points"]}):
            pts = sorted((p for p in sw["points"] if p["family"] == fam), key=lambda p: p["tree_nodes"])
            ax.plot([p["tree_nodes"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", label=fam)
            for p in pts:
                ax.annotate(p["label"], (p["tree_nodes"], p["tokens_per_s"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.axhline(sw["ar_tokens_per_s"], color="k", lw=0.8, ls="--", label="ar")
        ax.set_xscale("log")
        nodes = sorted({p["tree_nodes"] for p in sw["points"]})
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.minorticks_off()
        ax.set_xlabel("tree nodes verified per round")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=8)
        _save(fig, out / "tree_size.png")
        plt.close(fig)
        files.append("tree_size.png")
    if _rows_vs_size(conds, out, plt):
        files.append("rate_vs_tree_size.png")
    return files


def _rows_vs_size(conds: list[dict], out: Path, plt) -> bool:
    """tokens/s against the mean tree size each engine row verified, one panel per condition:
    where a policy sits relative to the fixed shapes at the same tree size."""
    panels = [(c, [r for r in ok_rows(c, "engine") if r.get("mean_tree_size") is not None]) for c in conds]
    panels = [(c, rs) for c, rs in panels if rs]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    for ax, (cond, rows) in zip(axes.flat, panels):
        for r in rows:
            kind = "o" if not r.get("dynamic") else ("D" if "grow" in r["name"] else "s")
            ax.plot(r["mean_tree_size"], r["tokens_per_s"]["median"], kind, ms=6,
                    color="C0" if not r.get("dynamic") else ("C3" if "grow" in r["name"] else "C1"))
            ax.annotate(r["name"], (r["mean_tree_size"], r["tokens_per_s"]["median"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_title(cond["name"], fontsize=9)
        ax.set_xlabel("mean draft tree nodes per round (o fixed, s pruned, D grown)", fontsize=8)
        ax.set_ylabel("tokens/s (median over repeats)", fontsize=8)
    fig.tight_layout()
    _save(fig, out / "rate_vs_tree_size.png")
    plt.close(fig)
    return True


def serve_plot(summary: dict, path: Path) -> str:
    """The serve suite's tokens/s by concurrent clients, a line a server (llama.cpp's -np N rows
    joined across N), the repeats' [min, max] as error bars; summary: serve_suite.summary's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple]] = {}
    for key, v in summary.items():
        row, n = key.rsplit(" @ ", 1)
        row = row.rsplit(" -np ", 1)[0] + " -np N" if " -np " in row else row
        lines.setdefault(row, []).append((int(n), v["tok_s"], *v["range"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row, pts in sorted(lines.items()):
        pts.sort()
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=row,
                    linestyle="--" if row.startswith("llama") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({n for pts in lines.values() for n, *_ in pts}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tokens/s, all requests (median of repeats)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)
    return path.name
