"""results.json + results.md of the serve-check (atomic writes)."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path


def trim(ids: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and without the first EOS (engines differ in whether they return it)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return list(ids)


def _rate(tokens: list[int], seconds: list[float]) -> float:
    return round(sum(tokens) / sum(seconds), 2) if sum(seconds) else 0.0


SD_ROW = "specstop sd --gamma 3 --stop fixed --head-window 0"
"""The contract's speculative row (training/export/paired.py: the head over the whole context, as vLLM's)."""
COMPARED = (("specstop ar", "vLLM plain"), ("specstop default", "vLLM + head"), (SD_ROW, "vLLM + head"))
"""(ours, theirs): the ratios reported with a 95% CI over prompts."""


def _ratios(per_prompt: dict, dtypes) -> dict:
    """ours / theirs in tokens per second, paired over prompts, with a percentile-bootstrap 95%
    interval (decoding.bench.stats.speedup_ci: resampling prompts, one pass each)."""
    from decoding.bench.stats import speedup_ci

    out = {}
    for dtype in dtypes:
        for a, b in COMPARED:
            ra, rb = per_prompt.get(f"{dtype}/{a}"), per_prompt.get(f"{dtype}/{b}")
            if ra and rb:
                point, lo, hi = speedup_ci([ra["tokens"]], [ra["seconds"]], [rb["tokens"]], [rb["seconds"]])
                out[f"{dtype}: {a} / {b}"] = [round(point, 3), round(lo, 3), round(hi, 3)]
    return out


def summarise(cfg, rows, mine: dict, theirs: dict, eos: set[int], fails: list[str], total_s: float) -> dict:
    runs, speed, timed = theirs["runs"], {}, {}
    for dtype in cfg.dtypes:
        plain = runs.get(f"{dtype}/plain")
        for name, r in (("vLLM plain", plain), ("vLLM + head", runs.get(f"{dtype}/head")),
                        ("specstop ar", mine.get(f"{dtype}/ar")), ("specstop default", mine.get(f"{dtype}/default")),
                        (SD_ROW, mine.get(f"{dtype}/sd"))):
            if r is None:
                continue
            toks = r.get("tokens") or [len(o) for o in r["outputs"]]
            speed[f"{dtype}/{name}"] = _rate(toks, r["seconds"])
            timed[f"{dtype}/{name}"] = {"tokens": list(toks), "seconds": [round(x, 4) for x in r["seconds"]]}
    head = runs["float32/head"]
    per_prompt = [{"id": r["id"], "kind": r["kind"], "vllm_accepted": a, "specstop_accepted": b, "vllm_drafted": d}
                  for r, a, b, d in zip(rows, head["accepted"], mine["float32/sd"]["accepted"], head["drafted"])]
    acc_len = {}
    for kind in ("general", "code"):
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        drafted = sum(head["drafted"][i] for i in idx)
        # vLLM drafts gamma tokens per round: rounds = drafted / gamma; length = 1 + accepted per round
        rounds = drafted / cfg.gamma if drafted else 0
        acc_len[kind] = round(1 + sum(head["accepted"][i] for i in idx) / rounds, 3) if rounds else None
    bf16 = None
    if "bfloat16/head" in runs:
        bf16 = sum(trim(a, eos) == trim(b, eos) for a, b in
                   zip(runs["bfloat16/head"]["outputs"], runs["bfloat16/plain"]["outputs"]))
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": theirs.get("vllm"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": 1, "note": "timings of one run, vLLM and specstop alternating prompt by prompt (one engine of each alive)"},
        "config": asdict(cfg), "prompts": [{"id": r["id"], "kind": r["kind"]} for r in rows],
        "contract": {"ok": not fails, "failures": fails,
                     "checks": "fp32: vLLM + head (eagle3 export; and the speculators export served as "
                               "`vllm serve DIR` does) == plain vLLM == specstop ar == specstop sd (tokens); "
                               f"their accepted draft tokens == {SD_ROW} (per prompt)",
                     "speculators_export_checked": "float32/speculators" in runs},
        "accepted_per_prompt": per_prompt, "vllm_mean_acceptance_length": acc_len,
        "bf16_head_equals_plain": None if bf16 is None else f"{bf16}/{len(rows)}",
        "tokens_per_s": speed, "ratios_ci": _ratios(timed, cfg.dtypes), "per_prompt_timing": timed,
        "speedup_vllm_head_over_plain": {d: round(speed[f"{d}/vLLM + head"] / speed[f"{d}/vLLM plain"], 3)
                                         for d in cfg.dtypes if speed.get(f"{d}/vLLM plain")},
        "construct_s": {k: round(v["construct_s"], 1) for k, v in runs.items()},
        "total_s": round(total_s, 1),
    }


def write_report(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _atomic(out / "results.json", json.dumps(result, indent=2) + "\n")
    c = result["contract"]
    lines = [f"# serve-check {result['when']} (vLLM {result['vllm']})", "",
             "Command: `make serve-check` (`python -m training.export.check`). "
             f"{len(result['prompts'])} held-out prompts, {result['config']['max_new_tokens']} greedy tokens, "
             "one thread. " + result["machine"]["note"] + ".", "",
             f"**Contract: {'holds' if c['ok'] else 'BROKEN'}** ({c['checks']}).", ""]
    lines += [f"- {f}" for f in c["failures"]]
    lines += ["", "| prompt | kind | vLLM accepted | specstop sd accepted |", "|---|---|---:|---:|"]
    lines += [f"| {p['id']} | {p['kind']} | {p['vllm_accepted']} | {p['specstop_accepted']} |"
              for p in result["accepted_per_prompt"]]
    acc = result["vllm_mean_acceptance_length"]
    lines += ["", f"vLLM mean acceptance length (fp32, tokens per target step): general {acc['general']}, "
                  f"code {acc['code']}. bf16 vLLM + head equal to plain vLLM: {result['bf16_head_equals_plain']}.",
              "", "| run | tokens/s |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in result["tokens_per_s"].items()]
    if result.get("ratios_ci"):
        lines += ["", "Ours over vLLM, tokens per second paired over prompts [95% CI, bootstrap over prompts]:", "",
                  "| dtype: ours / vLLM | ratio [95% CI] |", "|---|---|"]
        lines += [f"| {k} | {p:.2f}x [{lo:.2f}, {hi:.2f}] |" for k, (p, lo, hi) in result["ratios_ci"].items()]
    lines += ["", f"vLLM + head over plain vLLM: {result['speedup_vllm_head_over_plain']}. "
                  f"vLLM construction (s): {result['construct_s']}. Total {result['total_s']} s.", ""]
    _atomic(out / "results.md", "\n".join(lines))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
