"""The GPU suite's report (decoding.bench.gpu_suite): a markdown page and the cost-curve plot."""

from __future__ import annotations

from pathlib import Path


def _ratio(r: dict | None) -> str:
    if not r:
        return "-"
    lo, hi = r["ci95"]
    return f"{r['median']:.2f}x [{lo:.2f}, {hi:.2f}]"


def _equal(r: dict) -> str:
    return "-" if r.get("equal_to_hf_generate") is None else f"{r['equal_to_hf_generate']}/{r['prompts']}"


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# GPU suite ({m['date']})", "",
             f"{m['device']}, {m['dtype']}, our rows on the {m['forward']} forward, torch {m['torch']}; "
             f"{len(m['prompts'])} held-out prompts (chat template where the tokenizer has one, greedy); ratios: median with a 95% "
             f"bootstrap interval over prompts. The suite ran {m.get('elapsed_s', 0):.0f} s.", ""]
    for n, cond in res["conditions"].items():
        lines += [f"## {n} new tokens", "", "| row | tok/s | over HF generate | over our ar | equal to HF generate "
                  "| tokens / round | ms / round |", "|---|---|---|---|---|---|---|"]
        for name, r in cond.items():
            per = (f"{r['tokens_per_round']:.2f} | {r['ms_per_round']:.2f}" if "tokens_per_round" in r else "- | -")
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {_ratio(r.get('over_hf_generate'))} | "
                         f"{_ratio(r.get('over_ar'))} | {_equal(r)} | {per} |")
        lines.append("")
    for name, why in res.get("failed_rows", {}).items():
        lines += [f"Row {name} failed and was dropped: {why}", ""]
    skipped = [n for n in m["config"]["new_tokens"] if str(n) not in res["conditions"]]
    if skipped:
        lines += [f"Skipped for the time budget: {', '.join(map(str, skipped))} new tokens.", ""]
    counts = {k: v for k, v in res.get("launches", {}).items() if isinstance(v, dict)}
    if counts:
        lines += ["## A round's eager work besides the graph replays (`decoding.bench.launches`, untimed)", "",
                  "| row | tokens / round | kernels / round | of which on the device | host reads / round |",
                  "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['tokens_per_round']:.2f} | {v['kernels_per_round']:.0f} | "
                  f"{v['device_kernels_per_round']:.0f} | {v.get('host_reads_per_round', v['item_reads_per_round']):.1f} |"
                  for k, v in counts.items()]
        lines.append("")
    split = {k: v for k, v in res.get("round_split", {}).items() if isinstance(v, dict)}
    if split:
        lines += ["## A device round's ms by step (each step captured alone, median of 30 replays)", "",
                  "| row | draft | verify | accept + commit | whole round |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['draft_ms']:.3f} | {v['verify_ms']:.3f} | {v['accept_commit_ms']:.3f} | {v['round_ms']:.3f} |"
                  for k, v in split.items()]
        lines.append("")
    c = {k: v for k, v in res["cost"].items() if k != "failed"}
    lines += ["## Cost of one target forward by tokens fed (ms)", "", "![cost](cost.png)", "",
              "| tokens | " + " | ".join(k for k in c if k not in ("sizes", "cpu")) + " |",
              "|---|" + "---|" * len([k for k in c if k not in ("sizes", "cpu")])]
    for i, n in enumerate(c["sizes"]):
        lines.append(f"| {n} | " + " | ".join(f"{c[k][i]:.3f}" for k in c if k not in ("sizes", "cpu")) + " |")
    cpu = c.get("cpu", {})
    lines += ["", f"CPU curve: {cpu.get('source') or cpu.get('missing', '-')}", "",
              "## The `cuda` defaults entry picked", "", "```", *(f"{k}: {v}" for k, v in res["cuda_defaults"].items()),
              "```", "", "`defaults.yaml` here is decoding/defaults.yaml with this entry; copy it over to adopt it.", ""]
    return "\n".join(lines)


def cost_plot(cost: dict, path: Path) -> None:
    """ms per forward by tokens fed: the device's curves, the CPU's on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for k, ms in cost.items():
        if k not in ("sizes", "cpu", "failed"):
            ax.plot(cost["sizes"], ms, marker="o", label=f"device, {k}")
    ax.set_xlabel("tokens fed in one forward")
    ax.set_ylabel("ms (device)")
    cpu = cost.get("cpu", {})
    if "target_ms" in cpu:
        ax2 = ax.twinx()
        ax2.plot(cpu["sizes"], cpu["target_ms"], color="gray", linestyle="--", label="CPU (stored)")
        ax2.set_ylabel("ms (CPU)")
        ax2.legend(loc="lower right")
    ax.legend(loc="upper left")
    ax.set_title("target forward cost by tree size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
