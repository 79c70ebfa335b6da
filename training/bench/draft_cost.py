"""Step cost of drafts as a fraction of a target step, side by side, at several thread counts.

    python -m training.bench.draft_cost --draft checkpoints/drafts/A --draft checkpoints/drafts/B \
        [--threads 1 2] [--out reports/draft/cost.json] [--speed-prompts 8]

Every draft is timed against the target in the same process (training.draft.evaluate's
step_cost: batch 1, one new token with a KV cache, target and draft interleaved, median of
repeats), so drafts are compared under the same machine load. The ratio depends on the
thread count: the target's matrix products use a second core, the draft's overhead-bound
step barely does. With --speed-prompts N, the drafts also decode (sd gamma 4 and ar, greedy,
64 new tokens) the first N held-out prompts of each kind, drafts alternating prompt by
prompt, so what the cost buys back in block efficiency is measured under the same load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decoding.options import add_option


def main(argv: list[str] | None = None) -> None:
    from decoding.models import ModelError, load_model, resolve_model_dir

    from training.draft.evaluate import step_cost
    from training.shards import write_text

    p = argparse.ArgumentParser(prog="python -m training.bench.draft_cost", description=__doc__.split("\n")[0])
    add_option(p, "draft", several=True, required=True)
    add_option(p, "target")
    add_option(p, "threads", several=True, default=[1, 2])
    add_option(p, "dtype", default="bfloat16")
    add_option(p, "repeats", default=7)
    add_option(p, "out")
    p.add_argument("--speed-prompts", type=int, default=0, help="held-out prompts per kind to decode")
    a = p.parse_args(argv)
    try:
        for d in a.draft:  # a bad path fails before the target is loaded
            resolve_model_dir(d)
        target = load_model(a.target, a.dtype)
        drafts = {d: load_model(d, a.dtype) for d in a.draft}
    except ModelError as e:
        raise SystemExit(f"error: {e}") from None
    rows = []
    for n in a.threads:
        torch.set_num_threads(n)
        for name, draft in drafts.items():
            c = step_cost(target, draft, repeats=a.repeats)
            rows.append({"draft": name, "threads": n} | c)
            print(f"threads {n}  {name}: draft {c['draft_step_ms']} ms / target "
                  f"{c['target_step_ms']} ms = {c['cost_ratio']} {c['cost_ratio_min_max']}",
                  file=sys.stderr, flush=True)
    out = {"cost": rows}
    if a.speed_prompts:
        out["speed"] = speed(target, drafts, a.speed_prompts, a.target)
    if a.out:
        write_text(Path(a.out), json.dumps(out, indent=1) + "\n")


def speed(target, drafts: dict, n: int, target_dir: str | None = None) -> dict:
    """Per kind and draft: sd gamma 4 totals (and ar once), prompt by prompt, drafts interleaved."""
    from training.draft.evaluate import KINDS, engine_runs, eval_corpus

    eos = target.generation_config.eos_token_id
    res: dict = {}
    for kind in KINDS:
        rows = eval_corpus(kind, n, Path(".cache/eval_corpus") / (Path(target_dir).name if target_dir else ""),
                           "bfloat16", target_dir)
        tot: dict = {}
        for r in rows:
            for i, (name, draft) in enumerate(drafts.items()):
                strategies = ("ar", "sd") if i == 0 else ("sd",)  # ar once per prompt
                for strat, m in engine_runs(target, draft, [r], 64, eos, strategies).items():
                    key = "ar" if strat == "ar" else f"{strat} {name}"
                    t = tot.setdefault(key, {"new_tokens": 0, "target_calls": 0, "wall_s": 0.0})
                    for k in t:
                        t[k] += m[k]
        res[kind] = {k: t | {"tokens_per_s": round(t["new_tokens"] / t["wall_s"], 2),
                             "block_efficiency": round(t["new_tokens"] / t["target_calls"], 3)}
                     for k, t in tot.items()}
        for k, t in res[kind].items():
            print(f"{kind} {k}: {t['tokens_per_s']} tok/s, block efficiency {t['block_efficiency']}",
                  file=sys.stderr, flush=True)
    return res


if __name__ == "__main__":
    main()
