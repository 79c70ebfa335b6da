"""The dtype suite: which dtype decodes fastest on this machine, measured, not guessed from CPU
flags (`python -m decoding.bench --suite dtype [--config C] [--target DIR --draft DIR]`).

The pair is loaded once per dtype; `ar` and the default configuration run in each, every
row interleaved with the others within each repeat on the same greedy prompts, so a burst of
load hits every row alike. Each dtype's grown tree (if the default grows one) times its own
cost curve. Reported: tokens/s per row and dtype, the paired float32 / bfloat16 ratio with a
bootstrap CI over prompts, and the fastest speculative row over the fastest `ar` row, which
is the speedup a user gets over the best plain decoding the machine offers.
"""

from __future__ import annotations

import time
from pathlib import Path

from decoding.bench.config import BenchConfig, load_prompts
from decoding.bench.report import write_atomic, write_json
from decoding.bench.stats import RESAMPLES, speedup_ci
from decoding.options import GROW

DTYPES = ("float32", "bfloat16")


def _grows(d) -> bool:
    return (d.confidence_rule if d.stop == "confidence" else d.decider_rule) == GROW


def _decoders(cfg: BenchConfig) -> dict[str, object]:
    from decoding.api import Decoder

    rows = {}
    for dt in DTYPES:
        base = Decoder.load(cfg.target, cfg.draft, dtype=dt, device=cfg.device, strategy="ar")
        base.session.cost_cache = False  # a benchmark times its cost curves afresh
        rows[f"ar {dt}"] = base
        if base.session.draft is not None:  # each dtype's grown tree times its own cost curve
            rows[f"default {dt}"] = base.default_variant(**({"grow_cost": "measure"} if _grows(base.defaults) else {}))
    return rows


def run_dtypes(cfg: BenchConfig, prompts: list[str], command: str) -> dict:
    """prompts: texts (chat template per cfg.chat). Greedy, cfg.max_new_tokens each."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    rows = _decoders(cfg)
    for d in rows.values():  # warm-up
        d.generate(prompts[0], max_new_tokens=8, chat=cfg.chat)
    tok = {k: [] for k in rows}
    wall = {k: [] for k in rows}
    out = {k: [] for k in rows}
    for rep in range(cfg.repeats):
        for k in rows:
            tok[k].append([])
            wall[k].append([])
        for i, p in enumerate(prompts):
            for k, d in rows.items():
                r = d.generate(p, max_new_tokens=cfg.max_new_tokens, chat=cfg.chat, seed=cfg.seed + i)
                tok[k][rep].append(len(r.token_ids))
                wall[k][rep].append(r.stats["wall_s"])
                if rep == 0:
                    out[k].append(r.token_ids)
    res = {"meta": {"command": command, "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
                    "prompts": len(prompts), "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens,
                    "default": next(iter(rows.values())).defaults.describe(), "wall_s": None}, "rows": {}}
    for k in rows:
        res["rows"][k] = {"tokens_per_s": sum(map(sum, tok[k])) / sum(map(sum, wall[k])),
                          "equal_to_ar_same_dtype": out[k] == out[f"ar {k.split()[-1]}"]}
    res["ratios"] = {}
    for name in ("ar", "default"):
        a, b = f"{name} float32", f"{name} bfloat16"
        if a in rows:
            point, lo, hi = speedup_ci(tok[a], wall[a], tok[b], wall[b], RESAMPLES, seed=cfg.seed)
            res["ratios"][f"{name}: float32 / bfloat16"] = {"point": point, "ci95": [lo, hi]}
    spec = [k for k in rows if not k.startswith("ar ")]
    if spec:
        fast_ar = max((k for k in rows if k.startswith("ar ")), key=lambda k: res["rows"][k]["tokens_per_s"])
        fast = max(spec, key=lambda k: res["rows"][k]["tokens_per_s"])
        point, lo, hi = speedup_ci(tok[fast], wall[fast], tok[fast_ar], wall[fast_ar], RESAMPLES, seed=cfg.seed)
        res["ratios"][f"{fast} / {fast_ar} (fastest over fastest)"] = {"point": point, "ci95": [lo, hi]}
    res["meta"]["wall_s"] = time.perf_counter() - t0
    return res


def dtype_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Which dtype is fastest here ({m['date']}, {m['threads']} threads)", "",
             f"`{m['command']}`: {m['prompts']} prompts, {m['repeats']} interleaved repeats, "
             f"{m['max_new_tokens']} new tokens, greedy. Default configuration: {m['default']} "
             f"(each dtype's grown tree times its own cost curve).", "",
             "| row | tokens/s | output equal to ar in the same dtype |", "|---|---|---|"]
    notes = ["", "float32 is exact: a speculative row must equal `ar` there. In bfloat16 a batched "
                 "verification may flip a near-tie, so `False` there is expected; the compare suite "
                 "tells near-ties from mismatches."]
    for k, r in res["rows"].items():
        lines.append(f"| {k} | {r['tokens_per_s']:.2f} | {r['equal_to_ar_same_dtype']} |")
    lines += ["", "| ratio | paired [95% CI] |", "|---|---|"]
    for k, r in res["ratios"].items():
        lines.append(f"| {k} | {r['point']:.3f}x [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] |")
    return "\n".join(lines + notes) + "\n"


def dtype_main(cfg: BenchConfig, out: Path, command: str) -> str:
    prompts = [p["prompt"] for path in cfg.prompt_sets.values() for p in load_prompts(path, cfg.prompts_per_set)]
    res = run_dtypes(cfg, prompts, command)
    md = dtype_markdown(res)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", res)
    write_atomic(out / "results.md", md)
    return md
