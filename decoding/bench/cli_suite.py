"""The CLI suite: what a user of `python -m decoding.generate` waits for, end to end
(`python -m decoding.bench --suite cli [--prompts 4] [--new-tokens 96] [--repeats 3]`).

Each call is a fresh process, as a user runs it: interpreter and imports, loading the target
(and the head, the decider, the stored cost curve), then generation. The defaults (no
strategy named) and `--strategy ar` run on the same held-out prompts (the first --prompts of
each kind, chat template), alternating which goes first per prompt, so load from elsewhere
hits both alike. Before them, one default call with $SPECSTOP_RETIME_COST=1 stands for a
first call on a new machine (the grown tree's cost curve is timed then and stored). Reported:
wall seconds per call (process), the part spent generating (the CLI's own wall_s), the rest
(start-up and loading), and the default's end-to-end speed over ar's with a 95% interval over
prompts (paired, decoding.bench.stats).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from decoding.bench.config import BenchConfig, load_prompts
from decoding.bench.stats import speedup_ci

FILES = BenchConfig().prompt_sets
"""The held-out prompt sets every benchmark uses."""
VARIANTS = {"default": [], "ar": ["--strategy", "ar"]}


def run_cli(prompt: str, extra: list[str], new_tokens: int, threads: int | None, env: dict | None = None) -> dict:
    """One `python -m decoding.generate --json` process: its wall seconds and its stats."""
    cmd = [sys.executable, "-m", "decoding.generate", "--prompt", prompt, "--chat", "--json",
           "--max-new-tokens", str(new_tokens), *extra] + (["--threads", str(threads)] if threads else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    s = out["stats"]
    return {"wall_s": wall, "generate_s": s["wall_s"], "tokens": s["new_tokens"], "strategy": s["strategy"],
            "tokens_per_s": s["tokens_per_s"], "token_ids": out["token_ids"]}


def cli_suite(prompts: int = 4, new_tokens: int = 96, repeats: int = 3, threads: int | None = None,
              progress=print) -> dict:
    rows = [dict(r, kind=k) for k, f in FILES.items() for r in load_prompts(f, prompts)]
    first = run_cli(rows[0]["prompt"], VARIANTS["default"], new_tokens, threads, {"SPECSTOP_RETIME_COST": "1"})
    progress(f"first call (cost curve timed): {first['wall_s']:.1f} s")
    calls = {v: [[None] * len(rows) for _ in range(repeats)] for v in VARIANTS}
    for r in range(repeats):
        for i, row in enumerate(rows):
            order = list(VARIANTS) if (r + i) % 2 == 0 else list(VARIANTS)[::-1]
            for v in order:
                calls[v][r][i] = run_cli(row["prompt"], VARIANTS[v], new_tokens, threads)
            progress(f"repeat {r + 1}/{repeats} prompt {i + 1}/{len(rows)}: "
                     + ", ".join(f"{v} {calls[v][r][i]['wall_s']:.1f} s" for v in VARIANTS))
    res = {"prompts": [{"id": x["id"], "kind": x["kind"]} for x in rows], "new_tokens": new_tokens,
           "repeats": repeats, "threads": threads, "first_call": {k: v for k, v in first.items() if k != "token_ids"},
           "variants": {}}
    for v, m in calls.items():
        flat = [c for rep in m for c in rep]
        res["variants"][v] = {
            "strategy": flat[0]["strategy"],
            "median_wall_s": statistics.median(c["wall_s"] for c in flat),
            "median_generate_s": statistics.median(c["generate_s"] for c in flat),
            "median_startup_s": statistics.median(c["wall_s"] - c["generate_s"] for c in flat),
            "median_tokens_per_s_running": statistics.median(c["tokens_per_s"] for c in flat),
            "tokens": [[c["tokens"] for c in rep] for rep in m], "wall_s": [[c["wall_s"] for c in rep] for rep in m]}
    d, a = res["variants"]["default"], res["variants"]["ar"]
    res["default_over_ar_end_to_end"] = speedup_ci(d["tokens"], d["wall_s"], a["tokens"], a["wall_s"])
    by_kind = {}
    for kind in FILES:
        idx = [i for i, x in enumerate(rows) if x["kind"] == kind]
        by_kind[kind] = speedup_ci(*(np.asarray(v[k])[:, idx] for v in (d, a) for k in ("tokens", "wall_s")))
    res["default_over_ar_by_kind"] = by_kind
    res["outputs_equal"] = sum(calls["default"][0][i]["token_ids"] == calls["ar"][0][i]["token_ids"]
                               for i in range(len(rows)))
    return res


def cli_markdown(res: dict, command: str, cpu: str) -> str:
    f, d, a = res["first_call"], res["variants"]["default"], res["variants"]["ar"]
    pt, lo, hi = res["default_over_ar_end_to_end"]
    lines = [f"# A CLI call end to end: defaults vs `--strategy ar` ({res['new_tokens']} tokens)", "",
             f"`{command}`", "", f"CPU: {cpu}; threads: {res['threads'] or 'torch default'}; "
             f"{len(res['prompts'])} held-out prompts x {res['repeats']} repeats, one fresh process per call, "
             "variants alternating.", "",
             "| call | median wall s | generating s | start-up + loading s | tok/s once running |",
             "|---|---|---|---|---|",
             f"| first default call (cost curve timed, `SPECSTOP_RETIME_COST=1`) | {f['wall_s']:.2f} | "
             f"{f['generate_s']:.2f} | {f['wall_s'] - f['generate_s']:.2f} | {f['tokens_per_s']:.1f} |"]
    for name, v in (("default (later calls)", d), ("`--strategy ar`", a)):
        lines.append(f"| {name}: {v['strategy']} | {v['median_wall_s']:.2f} | {v['median_generate_s']:.2f} | "
                     f"{v['median_startup_s']:.2f} | {v['median_tokens_per_s_running']:.1f} |")
    lines += ["", f"Default over ar, end-to-end tokens per wall second: **{pt:.2f}x** [95% CI {lo:.2f}, {hi:.2f}]"
              + "; by kind: " + ", ".join(f"{k} {v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]"
                                           for k, v in res["default_over_ar_by_kind"].items()) + ".",
              f"Outputs equal to ar's (first repeat): {res['outputs_equal']}/{len(res['prompts'])}.", ""]
    return "\n".join(lines)
