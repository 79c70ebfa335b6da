"""Turning measured rows into the report: bound rows, goals, results.md (plots: bench.plots).
Every number here is computed from results.json; nothing is hard-coded."""

from __future__ import annotations

import json
import math
from pathlib import Path

from decoding.bench.agreement import TIE_ULPS
from decoding.bench.config import BenchConfig
from decoding.bench.oracle import LABEL, reference_row
from decoding.bench.stats import speedup_ci


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _clean(obj):
    """JSON-safe: NaN/inf -> None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(_clean(obj), indent=1))


def ok_rows(cond: dict, kind: str | None = None) -> list[dict]:
    return [r for r in cond["rows"] if r["status"] == "ok" and (kind is None or r["kind"] == kind)]


def add_bound_rows(results: dict, cfg: BenchConfig) -> None:
    """Where the traces' temperature matches a condition, a row estimating the oracle-stop
    tokens/s: the measured reference row x (replayed oracle / replayed full depth)."""
    b = results["oracle"]
    if b["status"] != "ok":
        return
    ref = reference_row(b, cfg.strategies)
    b["reference_row"] = ref
    temp = float((b.get("collect") or {}).get("temperature", 0.0))
    for cond in results["conditions"]:
        if ref is None or cond["temperature"] != temp:
            continue
        rows = {r["name"]: r for r in ok_rows(cond)}
        if ref not in rows or "ar" not in rows:
            continue
        est = rows[ref]["tokens_per_s"]["median"] * b["oracle_over_full_depth"]
        cond["rows"].append({"name": LABEL, "kind": "bound", "status": "ok", "lossless": True,
                             "reference": ref, "tokens_per_s": {"median": est},
                             "speedup": {"median": est / rows["ar"]["tokens_per_s"]["median"]}})


def _paired(a: dict, b: dict, resamples: int, seed: int) -> tuple[float, float, float]:
    """(speedup, 95% CI low, high) of row a over row b: median over the interleaved repeats of
    the ratio of tokens/s, bootstrap over prompts (decoding.bench.stats)."""
    pa, pb = a["per_prompt"], b["per_prompt"]
    return speedup_ci(pa["tokens"], pa["wall_s"], pb["tokens"], pb["wall_s"], resamples, seed=seed)


def _verdict(value: float, lo: float, goal: float) -> str:
    """PASS only when the goal holds across the 95% interval, not just at the point estimate."""
    if not math.isfinite(value):
        return "n/a"
    if value < goal:
        return f"SHORT BY {100 * (1 - value / goal):.0f}%"
    if math.isfinite(lo) and lo >= goal:
        return "PASS"
    return f"NOT SHOWN (point estimate meets it; the 95% CI reaches down to {lo:.2f}x)"


def compute_goals(results: dict, cfg: BenchConfig) -> list[dict]:
    """Greedy conditions only, lossless rows of our engine, same dtype (one process)."""
    g, out = cfg.goals, []
    mcsd_ref = next((s.name for s in cfg.strategies if s.strategy == "mcsd" and s.stop == "fixed"
                     and s.engine_config().k_config == g.mcsd_reference.replace(" ", "")), None)
    for cond in results["conditions"]:
        if cond["temperature"] != 0:
            continue
        rows = {r["name"]: r for r in ok_rows(cond)}
        ours = [r for r in ok_rows(cond, "engine") if r["lossless"] and r["strategy"] != "ar"]
        learned = [r for r in ours if r["stop"] == "decider"]

        def best(cands, over):  # the candidate with the highest point estimate
            vals = [(_paired(r, over, cfg.bootstrap_resamples, cfg.seed), r["name"]) for r in cands]
            return max(vals, key=lambda v: v[0][0]) if vals else ((float("nan"),) * 3, None)

        checks = [("vs_ar", f">= {g.vs_ar}x over ar", g.vs_ar, "ar", ours),
                  ("dynamic_vs_mcsd", f">= {g.dynamic_vs_mcsd}x over fixed mcsd[{g.mcsd_reference}]",
                   g.dynamic_vs_mcsd, mcsd_ref, [r for r in ours if r["dynamic"]]),
                  ("vs_hf_assisted", f">= {g.vs_hf_assisted}x over HF assisted (same draft)",
                   g.vs_hf_assisted, "hf-assisted", ours)]
        fixed = [r for r in ours if not r["dynamic"]]
        if fixed:  # the fastest fixed shape measured in this condition (chosen in hindsight)
            ref = max(fixed, key=lambda r: r["tokens_per_s"]["median"])["name"]
            checks.append(("dynamic_vs_best_fixed", f">= {g.dynamic_vs_best_fixed}x over the fastest fixed shape",
                           g.dynamic_vs_best_fixed, ref, [r for r in ours if r["dynamic"]]))
            if g.learned_vs_best_fixed is not None:
                checks.append(("learned_vs_best_fixed", f">= {g.learned_vs_best_fixed}x (a decider row) over the "
                               f"fastest fixed shape", g.learned_vs_best_fixed, ref, learned))
        conf = [r for r in ours if r["stop"] == "confidence"]
        if g.learned_vs_confidence is not None and conf:  # the best confidence row, in hindsight too
            ref = max(conf, key=lambda r: r["tokens_per_s"]["median"])["name"]
            checks.append(("learned_vs_confidence", f">= {g.learned_vs_confidence}x (a decider row) over the "
                           f"fastest draft-confidence row", g.learned_vs_confidence, ref, learned))
        for key, text, goal, ref, cands in checks:
            item = {"goal": key, "text": text, "condition": cond["name"], "target": goal}
            if ref is None or ref not in rows:
                out.append({**item, "value": None, "best": None, "verdict": f"n/a: no measured {ref or 'reference'} row"})
                continue
            if not cands:
                out.append({**item, "value": None, "best": None, "verdict": "n/a: no measured candidate row"})
                continue
            (value, lo, hi), name = best(cands, rows[ref])
            out.append({**item, "value": value, "ci95": [lo, hi], "best": name, "reference": ref,
                        "verdict": _verdict(value, lo, goal)})
    return out


def compare_drafts(results: dict, cfg: BenchConfig) -> list[dict]:
    """Where rows ran with different drafts: per condition, each draft's fastest lossless row
    of our engine against the run draft's fastest (picked in hindsight, as the goals are), with
    the paired 95% interval. Empty for a one-draft run."""
    out = []
    for cond in results["conditions"]:
        best = {}
        for r in ok_rows(cond, "engine"):
            if r["lossless"] and r["strategy"] != "ar":
                k = r.get("draft")
                if k not in best or r["tokens_per_s"]["median"] > best[k]["tokens_per_s"]["median"]:
                    best[k] = r
        if len(best) < 2 or None not in best:
            continue
        ref = best.pop(None)
        for draft, r in best.items():
            value, lo, hi = _paired(r, ref, cfg.bootstrap_resamples, cfg.seed)
            out.append({"condition": cond["name"], "draft": draft, "best": r["name"], "reference": ref["name"],
                        "value": value, "ci95": [lo, hi]})
    return out


def _draft_lines(results: dict) -> list[str]:
    items = results.get("drafts") or []
    if not items:
        return []
    L = [f"## Drafts compared (each draft's fastest lossless row over the run draft's, {results['meta'].get('draft')})", ""]
    for d in items:
        L.append(f"- {d['condition']}: {d['best']} / {d['reference']} = **{_f(d['value'])}x** "
                 f"[{_f(d['ci95'][0])}, {_f(d['ci95'][1])}] (draft {d['draft']})")
    return L + [""]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def _speedup_cell(s: dict | None) -> str:
    if not s:
        return "–"
    ci = s.get("ci95")
    if ci and all(map(finite, ci)):
        return f"{s['median']:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"
    return f"{s['median']:.2f}x ({s['min']:.2f}..{s['max']:.2f})"


def _lossless_cell(r: dict) -> str:
    """What was checked: greedy rows against ar; sampled rows rest on the exact-sampling test."""
    eq = r.get("equal_to_ar")
    if eq and eq.get("mismatch"):
        return "**MISMATCH**" if r.get("configured_lossless", True) else "**NO (lossy)**"
    if not r["lossless"]:
        return "**NO (lossy)**"
    return "yes" if eq else "by the exact-sampling test"


def _equal_cell(eq: dict | None) -> str:
    if not eq:
        return "–"
    if "tie" not in eq:  # results written before ties were told apart
        return f"{eq['equal']}/{eq['n']}"
    cell = f"{eq['equal']}/{eq['tie']}/{eq['mismatch']} of {eq['n']}"
    return cell + " **MISMATCH**" if eq["mismatch"] else cell


def _table_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"| {r['name']} | {'yes' if r.get('lossless') else 'NO'} | {r['status']} |" + " |" * 7
    if r["kind"] == "bound":
        return (f"| **{r['name']}** (x {r['reference']}) | – | ≈{r['tokens_per_s']['median']:.1f} | "
                f"≈{r['speedup']['median']:.2f}x |" + " – |" * 6)
    t, s = r["tokens_per_s"], r["speedup"]
    eq = r.get("equal_to_ar")
    ag = r.get("agreement")
    return "| " + " | ".join([
        r["name"], _lossless_cell(r),
        f"{t['median']:.1f} ({t['min']:.1f}..{t['max']:.1f})",
        _speedup_cell(s),
        _f(r.get("block_efficiency")), _f(r.get("acceptance_rate")),
        _equal_cell(eq), _f(ag and ag["prefix_fraction"]),
        _f(r.get("loglik_per_token"), "{:.3f}"), _f(r.get("peak_mem_mb"), "{:.0f}")]) + " |"


def _profile_lines(results: dict) -> list[str]:
    lines = ["| strategy | T | draft | verify | bookkeeping | other | ms/round | acceptance | block eff. |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for cond in results["conditions"]:
        for r in ok_rows(cond, "engine"):
            by.setdefault((r["name"], cond["temperature"]), []).append(r)
    for (name, temp), rs in by.items():
        p = {k: sum(r["profile"][k] for r in rs) / len(rs) for k in ("draft", "verify", "bookkeeping", "other")}
        ms = [r["profile"]["ms_per_round"] for r in rs if r["profile"]["ms_per_round"]]
        acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
        be = [r["block_efficiency"] for r in rs if r["block_efficiency"]]
        lines.append(f"| {name} | {temp:g} | {p['draft']:.0%} | {p['verify']:.0%} | {p['bookkeeping']:.0%} | "
                     f"{p['other']:.0%} | {_f(sum(ms) / len(ms) if ms else None, '{:.1f}')} | "
                     f"{_f(sum(acc) / len(acc) if acc else None)} | {_f(sum(be) / len(be) if be else None)} |")
    return lines


def markdown(results: dict) -> str:
    m = results["meta"]
    L = [f"# Benchmark {m['date']}", "",
         (f"`{m['command']}` — target {m['target']}, draft {m['draft']}, decider {m.get('decider')}, {m['dtype']} on {m['device']}, "
         f"{m['threads']} thread(s), {m['prompts_per_set']} prompts per set, max {m['max_new_tokens']} new "
         f"tokens, {m['repeats']} repeats after a warm-up, wall {m['wall_s'] / 60:.1f} min. "
         "Speedup = median over repeats of tokens/s ÷ ar's in the same repeat (repeats interleave all "
         "rows, so background load hits them alike); [brackets] = its 95% confidence interval, a "
         f"percentile bootstrap over prompts ({(m.get('ci') or {}).get('resamples', '?')} resamples, "
         "paired with ar's runs in the same repeats); tok/s ranges are min..max over repeats."), ""]
    head = ("| strategy | lossless | tok/s (min..max) | speedup vs ar | block eff. | acceptance | "
            "equal / tie / mismatch vs ar | common prefix | LL/token | peak MB |")
    for cond in results["conditions"]:
        L += [f"## {cond['name']} (T={cond['temperature']:g}, {cond['n_prompts']} prompts)", "", head,
              "|" + "---|" * 10]
        L += [_table_row(r) for r in cond["rows"]]
        L.append("")
    L += [("Block eff. = tokens committed per target forward; acceptance = accepted / drafted tokens; "
          "equal / tie / mismatch vs ar = greedy outputs per prompt identical to ar's in this dtype / "
          f"first differing where the target's fp32 logits of the two tokens are within {TIE_ULPS} ulps of the "
          "dtype at the top logit (a near-tie that bf16 rounding in a batched verification flips) / "
          "differing for any other reason (MISMATCH: the row is reported as not lossless); sampled "
          "conditions are lossless by the exact-sampling test, not by comparison; common prefix = mean fraction of ar's output reproduced before the first "
          "difference; LL/token = mean target log-likelihood (T=1) of the generated tokens; peak MB = "
          "peak RSS (CUDA: allocated) above the pre-run baseline of the row's runs."), ""]
    L += _setting_lines(results) + _own_pair_lines(results) + _draft_lines(results)
    L += _oracle_lines(results["oracle"])
    L += ["## Goals (greedy, lossless, same dtype; computed from the rows above)", "",
          ("PASS only where the 95% CI of the speedup (bootstrap over prompts) clears the goal; the "
           "candidate shown is the one with the highest point estimate (picked after the fact)."), ""]
    for g in results["goals"]:
        ci = g.get("ci95") or [None, None]
        v = "–" if g["value"] is None else (f"{g['value']:.2f}x, 95% CI [{_f(ci[0])}, {_f(ci[1])}] "
                                            f"({g['best']} vs {g['reference']})")
        L.append(f"- **{g['text']}** — {g['condition']}: {v} — **{g['verdict']}**")
    if not results["goals"]:
        L.append("No greedy condition was measured: the goals are read on greedy decoding.")
    L += ["", "## Profile (share of wall time, mean over prompt sets)", ""] + _profile_lines(results)
    if results.get("sweep"):
        sw = results["sweep"]
        L += ["", (f"## Tokens/s vs tree size ({sw['prompts']} {sw['prompt_set']} prompts, greedy, "
                   f"{sw['max_new_tokens']} tokens; ar {sw['ar_tokens_per_s']:.1f} tok/s)"), "",
              "| tree | nodes | tok/s | speedup | block eff. | ms/round |", "|---|---|---|---|---|---|"]
        for p in sw["points"]:
            L.append(f"| {p['name']} | {p['tree_nodes']} | {p['tokens_per_s']:.1f} | {p['speedup']:.2f}x | "
                     f"{_f(p['block_efficiency'])} | {_f(p['ms_per_round'], '{:.1f}')} |")
    pngs = [f for f in m.get("files", []) if f.endswith(".png")]
    L += ["", "Plots: " + ", ".join(f"`{f}`" for f in pngs) + "."] if pngs else []
    return "\n".join(L) + "\n"


def _grow_caps(v: dict) -> str:
    per_node = (f"<= {','.join(map(str, v['level_widths']))} children per node by depth" if v.get("level_widths")
                else f"<= {v['max_width']} children per node")
    return f"{per_node}, <= {v['max_nodes']} nodes"


def _setting_lines(results: dict) -> list[str]:
    """The threshold each dynamic row really ran with, and where it came from."""
    seen = {}
    for cond in results["conditions"]:
        for r in cond["rows"]:
            if r.get("stop_setting"):
                seen.setdefault(r["name"], r["stop_setting"])
    if not seen:
        return []
    L = [f"Stop thresholds (decider {results['meta'].get('decider')}):", ""]
    L += [f"- {n}: {v['rule']} rule at {v['threshold']:.3g} ({v['source']})" if "threshold" in v else
          f"- {n}: grow rule over {v['scores']} scores, {_grow_caps(v)}, no threshold ({v['source']})"
          for n, v in seen.items()]
    return L + [""]


def _own_pair_lines(results: dict) -> list[str]:
    """Rows that ran with their own draft or decider instead of the run's."""
    own = {r["name"]: r for cond in results["conditions"] for r in cond["rows"] if r.get("draft") or r.get("decider")}
    if not own:
        return []
    m = results["meta"]
    L = [f"Rows with their own draft / decider (the others: draft {m.get('draft')}, decider {m.get('decider')}):", ""]
    L += [f"- {n}: draft {r.get('draft') or m.get('draft')}, decider {r.get('decider') or m.get('decider')}"
          for n, r in own.items()]
    return L + [""]


def _oracle_lines(b: dict) -> list[str]:
    L = [f"## {b['label']}", ""]
    if b["status"] != "ok":
        return L + [f"{b['status']}.", ""]
    rt = b["replay_tokens_per_s"]
    L.append(f"Source: {b['source']}; traces drafted {json.dumps(b.get('collect') or {})}. Replayed "
             f"tokens/s under the cost model: " + ", ".join(f"{k} {v:.1f}" for k, v in rt.items()) +
             f". Oracle / full depth ({b['full_depth']}) = {b['oracle_over_full_depth']:.3f}x, oracle / "
             f"best fixed ({b['best_fixed']}) = {b['oracle_over_best_fixed']:.3f}x.")
    if b.get("reference_row"):
        L.append(f"The bound rows above scale the measured `{b['reference_row']}` row by the first ratio.")
    for k, v in (b.get("deciders") or {}).items():
        L.append(f"- replayed {k}: {_f(v['tokens_per_s'], '{:.1f}')} tok/s, oracle share "
                 f"{_f(v['oracle_share'], '{:.2f}')} (threshold {_f(v['threshold'], '{:.3f}')})")
    return L + [""]
