"""`python -m decoding.bench.ties`: how often bf16 greedy runs reproduce `ar`, with the target's
final norm + output layer in bf16 (as loaded) or in fp32 (`models.set_head_dtype`).

For each head dtype: the default pair in bf16, `ar` and each speculative row on held-out
prompts; every row's outputs are judged against that condition's `ar` (equal / tie /
mismatch, decoding.bench.agreement) and each condition's `ar` against the fp32 model's `ar`.
Writes results.json and results.md (atomic). One pass, no repeats: the tokens/s are a cost
indication on a shared CPU, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from decoding import models
from decoding.bench.agreement import check_greedy, count_kinds
from decoding.bench.config import load_prompts
from decoding.bench.report import write_atomic, write_json
from decoding.sampling import SamplingConfig
from decoding.models.session import Session
from decoding.strategies import StrategyConfig, build_engine
from decoding.options import add_option

ROWS = (StrategyConfig(strategy="sd", gamma=4), StrategyConfig(strategy="ti-mcsd", width=4, depth=6))


def _run(engine, prompts, n, bar) -> tuple[list[list[int]], float]:
    outs, toks, wall = [], 0, 0.0
    for ids in prompts:
        t = time.perf_counter()
        out, _ = engine.generate(ids, n)
        wall += time.perf_counter() - t
        outs.append(out)
        toks += len(out)
        bar.update(1)
    return outs, toks / wall if wall else 0.0


def _judge(target, prompts, refs, outs) -> dict:
    checks = [check_greedy(target, p, r, o, "bfloat16") for p, r, o in zip(prompts, refs, outs)]
    return {**count_kinds(checks), "n": len(checks),
            "differences": [{"prompt": i, **asdict(c)} for i, c in enumerate(checks) if c.kind != "equal"]}


def measure(prompt_file: str, n_prompts: int, new_tokens: int) -> dict:
    texts = load_prompts(prompt_file, n_prompts)
    greedy = SamplingConfig()
    conds, fp32_ref, draft = [], None, None
    heads = ("float32 model", "bfloat16", "float32")
    bar = tqdm(total=n_prompts * (1 + 2 * (1 + len(ROWS))), desc="ties", file=sys.stderr)
    for head in heads:
        sess = Session.open(None, None, "float32" if head == "float32 model" else "bfloat16")
        if head == "float32":
            models.set_head_dtype(sess.target, "float32")
        prompts = [sess.encode(t["prompt"], chat=True) for t in texts]
        draft = os.path.relpath(sess.draft_dir) if sess.draft_dir else None  # no absolute paths in reports
        refs, ar_tok_s = _run(build_engine(sess.target, None, StrategyConfig(strategy="ar"), greedy),
                              prompts, new_tokens, bar)
        if head == "float32 model":  # the reference for "does bf16 ar reproduce fp32 ar"
            fp32_ref = refs
            continue
        cond = {"dtype": "bfloat16", "head_dtype": head, "ar_tokens_per_s": ar_tok_s,
                "ar_vs_fp32_ar": _judge(sess.target, prompts, fp32_ref, refs), "rows": []}
        for cfg in ROWS:
            outs, tok_s = _run(build_engine(sess.target, sess.draft, cfg, greedy), prompts, new_tokens, bar)
            cond["rows"].append({"name": cfg.name, "tokens_per_s": tok_s, "speedup": tok_s / ar_tok_s,
                                 "vs_ar": _judge(sess.target, prompts, refs, outs)})
        conds.append(cond)
        del sess
    bar.close()
    return {"meta": {"date": time.strftime("%Y-%m-%d"), "prompts": prompt_file, "n_prompts": n_prompts,
                     "new_tokens": new_tokens, "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "draft": draft},
            "conditions": conds}


def _kinds(k: dict) -> str:
    cell = f"{k['equal']}/{k['tie']}/{k['mismatch']} of {k['n']}"
    gaps = [f"{d['gap']:.3g}/{d['tolerance']:.3g}" for d in k["differences"] if d["gap"] is not None]
    return cell + (" **MISMATCH**" if k["mismatch"] else "") + (f" (gap/tolerance: {', '.join(gaps)})" if gaps else "")


def markdown(res: dict, command: str) -> str:
    m = res["meta"]
    L = [f"# bf16 ties: target head in bf16 vs fp32 ({m['date']})", "",
         f"`{command}` — default target + draft `{m['draft']}` in bf16, {m['n_prompts']} prompts of `{m['prompts']}`, "
         f"{m['new_tokens']} new tokens, greedy, {m['threads']} thread(s), torch {m['torch']}. One pass: "
         "tokens/s indicate cost on a shared CPU, they are not a benchmark.", "",
         "| head | row | tok/s | vs ar | equal / tie / mismatch vs this condition's ar |", "|---|---|---|---|---|"]
    for c in res["conditions"]:
        L.append(f"| {c['head_dtype']} | ar | {c['ar_tokens_per_s']:.1f} | 1.00x | – "
                 f"(vs the fp32 model's ar: {_kinds(c['ar_vs_fp32_ar'])}) |")
        for r in c["rows"]:
            L.append(f"| {c['head_dtype']} | {r['name']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{_kinds(r['vs_ar'])} |")
    L += ["", ("equal / tie / mismatch: outputs identical / first differing where the fp32 logits of "
               "both tokens lie within the tie tolerance of the top logit (decoding.bench.agreement; gap / "
               "tolerance listed, in logits) / differing for any other reason.")]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decoding.bench.ties", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "prompts_file", default="data/prompts/heldout_general.jsonl")
    ap.add_argument("-n", "--n-prompts", type=int, default=4)
    add_option(ap, "new_tokens", default=96)
    add_option(ap, "out", default="reports/ties")
    a = ap.parse_args(argv)
    if a.n_prompts < 1 or a.new_tokens < 1:
        print("error: --n-prompts and --new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        res = measure(a.prompts_file, a.n_prompts, a.new_tokens)
    except ValueError as e:  # ModelError included
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out = Path(a.out)
    command = "python -m decoding.bench.ties " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(out / "results.json", res)
    write_atomic(out / "results.md", markdown(res, command.strip()))
    print(markdown(res, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
