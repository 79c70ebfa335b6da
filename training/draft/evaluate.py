"""Measure a draft against its target on held-out prompts, general and code separately.

    python -m training.draft.evaluate --draft checkpoints/drafts/smollm2-135m-draft [--out reports/draft]

1. Teacher-forced, on target continuations of held-out prompts (written once with the
   corpus settings of configs/corpus.yaml, cached under .cache/eval_corpus/): top-1
   agreement, target argmax within the draft's top-4, expected acceptance sum_x min(p, q)
   over the full vocabulary (T = 1).
2. Engine runs (greedy, batch 1): acceptance rate and block efficiency of `sd` (gamma 4)
   and `mcsd` 4,2,2,1 on a few held-out prompts per kind (`ar` for a tokens/s reference;
   tokens/s on a shared CPU are indicative only).
3. Draft step cost as a fraction of a target step: same dtype, batch 1, one new token with
   a KV cache; target and draft timed alternately (a shared machine), median of repeats.
4. The learning curve of the draft's run (validation agreement vs training minutes), if its
   metrics.csv is given.
Writes <out>/eval.json, <out>/eval.md (+ learning_curve.png) and copies the held-out
figures into the draft's specstop_draft.json (atomic rewrite).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.options import add_option

from training.shards import write_text

KINDS = {"general": "data/prompts/heldout_general.jsonl", "code": "data/prompts/heldout_code.jsonl"}
PROMPT_SETS = {**KINDS, "magpie": "data/prompts/magpie_heldout.jsonl"}
"""Held-out prompt sets: the two kinds, and user turns the target wrote (training.corpus.magpie)
that no corpus holds: traffic unlike the templates."""


def eval_corpus(kind: str, n: int, root: Path, dtype: str, target: str | None = None,
                temperature: float = 0.7) -> list[dict]:
    """Target continuations of the first n held-out prompts of a kind (generated once;
    `target` None = the embedded target; temperature 0 = greedy, cached under root/greedy)."""
    from training.corpus.teacher import CorpusConfig, build_corpus, load_corpus, load_teacher, read_prompts

    if temperature != 0.7:
        root = root / ("greedy" if temperature == 0 else f"T{temperature:g}")
    cfg = CorpusConfig(prompt_files=[PROMPT_SETS[kind]], out=str(root / kind), target=target, dtype=dtype,
                       batch_size=8, shard_size=64, max_new_tokens=128, temperature=temperature)
    prompts = read_prompts(cfg.prompt_files, n)
    have = set()
    if (root / kind / "manifest.json").exists():
        have = set(load_corpus(root / kind)["prompt_id"])
    if any(p.id not in have for p in prompts):
        build_corpus(cfg, load_teacher(cfg), prompts, progress=False)
    rows = load_corpus(root / kind).to_list()
    want = {p.id for p in prompts}
    return [r for r in rows if r["prompt_id"] in want]


@torch.inference_mode()
def teacher_forced(target, draft, rows: list[dict]) -> dict:
    """Agreement / top-4 / sum-min over every completion token of the rows (one row at a time)."""
    from decoding.models import output_token_ids

    head = output_token_ids(draft)
    in_head = torch.ones(draft.config.vocab_size, dtype=torch.bool)
    if head is not None:  # an upper bound on agreement: the draft never proposes other ids
        in_head[:] = False
        in_head[head] = True
    n = agree = top4 = covered = 0
    accept = 0.0
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        a, b = len(r["prompt_ids"]) - 1, ids.shape[1] - 1
        lp = F.log_softmax(target(input_ids=ids).logits[0, a:b].float(), -1)
        lq = F.log_softmax(draft(input_ids=ids).logits[0, a:b].float(), -1)
        t1 = lp.argmax(-1)
        agree += int((lq.argmax(-1) == t1).sum())
        top4 += int((lq.topk(4, -1).indices == t1[:, None]).any(-1).sum())
        accept += float(torch.minimum(lp.exp(), lq.exp()).sum())
        covered += int(in_head[t1].sum())
        n += b - a
    return {"positions": n, "top1_agreement": agree / n, "target_top1_in_draft_top4": top4 / n,
            "expected_acceptance_summin": accept / n, "target_top1_in_draft_head": covered / n}


def engine_runs(target, draft, rows: list[dict], max_new: int, eos,
                strategies: tuple[str, ...] = ("ar", "sd", "mcsd")) -> dict:
    """Greedy totals per strategy: ar, sd (gamma 4), mcsd (4,2,2,1)."""
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    configs = {"ar": StrategyConfig("ar"), "sd": StrategyConfig("sd", gamma=4),
               "mcsd": StrategyConfig("mcsd", k_config="4,2,2,1")}
    out = {}
    for cfg in (configs[s] for s in strategies):
        eng = build_engine(target, draft, cfg, SamplingConfig())
        tot = {"drafted": 0, "accepted": 0, "new_tokens": 0, "target_calls": 0, "wall_s": 0.0}
        for r in rows:
            _, st = eng.generate(r["prompt_ids"], max_new_tokens=max_new, eos_token_id=eos, seed=0)
            for k in tot:
                tot[k] += getattr(st, k)
        out[cfg.name] = tot | {
            "prompts": len(rows),
            "acceptance_rate": round(tot["accepted"] / max(1, tot["drafted"]), 4),
            "block_efficiency": round(tot["new_tokens"] / max(1, tot["target_calls"]), 4),
            "tokens_per_s": round(tot["new_tokens"] / max(1e-9, tot["wall_s"]), 2)}
    return out


@torch.inference_mode()
def step_cost(target, draft, ctx: int = 128, steps: int = 30, repeats: int = 7) -> dict:
    """Median seconds of a batch-1 one-token KV-cached step, target and draft interleaved."""
    from transformers import DynamicCache

    def timed(m) -> float:
        v = m.config.vocab_size  # ids 100..999 of a real vocabulary, scaled down for tiny ones
        ids = torch.randint(min(100, v // 2), min(1000, v), (1, ctx), generator=torch.Generator().manual_seed(0))
        cache = DynamicCache(config=m.config)
        m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        x = torch.tensor([[min(500, v - 1)]])
        for _ in range(3):
            m(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        for _ in range(steps):
            m(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return (time.perf_counter() - t0) / steps

    t, d = [], []
    for _ in range(repeats):
        t.append(timed(target))
        d.append(timed(draft))
    ratios = [b / a for a, b in zip(t, d)]
    return {"target_step_ms": round(1e3 * statistics.median(t), 3),
            "draft_step_ms": round(1e3 * statistics.median(d), 3),
            "cost_ratio": round(statistics.median(ratios), 4),
            "cost_ratio_min_max": [round(min(ratios), 4), round(max(ratios), 4)],
            "threads": torch.get_num_threads(), "dtype": str(next(draft.parameters()).dtype)}


def full_head_copy(draft):
    """The same draft with a full-vocabulary output layer (None if its head is not pruned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoding.models import output_token_ids

    if output_token_ids(draft) is None:
        return None
    conf = {k: v for k, v in draft.config.to_dict().items() if k not in ("head_size", "model_type")}
    full = LlamaForCausalLM(LlamaConfig(**conf)).to(next(draft.parameters()).dtype).eval()
    state = {k: v for k, v in draft.state_dict().items() if not k.endswith("lm_head.ids")}
    full.load_state_dict(state, strict=False)
    full.tie_weights()
    return full


def learning_curve(csv: Path, png: Path, prior: list[dict] | None = None) -> list[dict]:
    """Validation agreement vs training minutes from a run's metrics.csv; `prior` = the earlier
    stages' points (a warm start's curve, itself possibly chained), drawn first. Every point
    keeps its stage and its minutes since the first stage began (total_minutes)."""
    import pandas as pd

    df = pd.read_csv(csv)
    if "val/agree" not in df:
        return []
    v = df[df["val/agree"].notna()]
    cols = [c for c in ("step", "train_minutes", "val/agree", "val/agree_general",
                        "val/agree_code", "val/accept") if c in v]
    prior = [q | {"stage": q.get("stage", 1), "total_minutes": q.get("total_minutes", q["train_minutes"])}
             for q in prior or []]
    offset = max((q["total_minutes"] for q in prior), default=0.0)
    stage = max((q["stage"] for q in prior), default=0) + 1
    pts = [{k: (float(x) if k != "step" else int(x)) for k, x in row.items()}
           for row in v[cols].to_dict("records")]
    pts = [q | {"stage": stage, "total_minutes": q["train_minutes"] + offset} for q in pts]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in sorted({q["stage"] for q in prior}):
        qs = [q for q in prior if q["stage"] == s]
        ax.plot([q["total_minutes"] for q in qs], [q["val/agree"] for q in qs], marker="o", ms=2,
                c=str(0.3 + 0.4 * s / stage), label=f"stage {s} (all)")
        ax.axvline(qs[-1]["total_minutes"], c="grey", lw=1, ls=":")
    x = [q["total_minutes"] for q in pts]
    for c, lab in (("val/agree", "all"), ("val/agree_general", "general"), ("val/agree_code", "code")):
        if c in v:
            ax.plot(x, [q[c] for q in pts], marker="o", ms=3, label=f"stage {stage} {lab}")
    ax.set_xlabel("training wall-clock minutes, all stages (shared 2-core CPU)")
    ax.set_ylabel("top-1 agreement (validation slice of the corpus)")
    ax.axhline(0.6, ls="--", c="grey", lw=1, label="target 0.6")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return prior + pts


def markdown(res: dict) -> str:
    lines = [f"# Draft evaluation: `{res['draft']}`", "",
             (f"Target: {res['target']}; dtype {res['dtype']}; threads {res['threads']}; "
              f"{res['date']}."), "",
             ("| held-out | prompts | positions | top-1 agree | target top-1 in draft top-4 | "
              "E[accept] sum min(p,q) |"), "|---|---|---|---|---|---|"]
    for k, m in res["teacher_forced"].items():
        lines.append(f"| {k} | {m['prompts']} | {m['positions']} | {m['top1_agreement']:.3f} | "
                     f"{m['target_top1_in_draft_top4']:.3f} | {m['expected_acceptance_summin']:.3f} |")
    lines += ["", "| held-out | strategy | prompts | acceptance rate | block efficiency | tokens/s |",
              "|---|---|---|---|---|---|"]
    for k, runs in res["engine"].items():
        for s, m in runs.items():
            lines.append(f"| {k} | {s} | {m['prompts']} | {m['acceptance_rate']:.3f} | "
                         f"{m['block_efficiency']:.3f} | {m['tokens_per_s']:.1f} |")
    c = res["cost"]
    lines += ["", (f"Draft step cost: {c['draft_step_ms']} ms vs target {c['target_step_ms']} ms "
                   f"= **{c['cost_ratio']}** of a target step (min/max over repeats "
                   f"{c['cost_ratio_min_max']}; batch 1, 1 new token, KV cache, {c['dtype']})."), ""]
    if "full_head" in c:
        f = c["full_head"]
        lines += [(f"The same draft with a full 49152-row output layer: {f['draft_step_ms']} ms vs "
                   f"{f['target_step_ms']} ms = {f['cost_ratio']} of a target step."), ""]
    if res.get("learning_curve"):
        lines += ["![learning curve](learning_curve.png)", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from decoding.models import DEFAULT_TARGET_NAME, ModelError, load_model

    p = argparse.ArgumentParser(prog="python -m training.draft.evaluate", description=__doc__.split("\n")[0])
    add_option(p, "draft", default="checkpoints/drafts/smollm2-135m-draft")
    add_option(p, "target")
    add_option(p, "out", default="reports/draft")
    add_option(p, "prompts", default=24)
    p.add_argument("--engine-prompts", type=int, default=4, help="held-out prompts per kind (engine runs)")
    add_option(p, "max_new_tokens", default=64)
    add_option(p, "dtype", default="bfloat16")
    add_option(p, "threads")
    add_option(p, "metrics_csv")
    p.add_argument("--prior-curve", default=None,
                   help="eval.json of the warm start: its learning curve is drawn first")
    add_option(p, "eval_cache")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    draft_dir = Path(a.draft)
    try:
        target, draft = load_model(a.target, a.dtype), load_model(draft_dir, a.dtype)
    except ModelError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    eos = target.generation_config.eos_token_id
    res = {"draft": str(draft_dir), "target": a.target or DEFAULT_TARGET_NAME, "dtype": a.dtype,
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "teacher_forced": {}, "engine": {}}
    for kind in KINDS:
        rows = eval_corpus(kind, a.prompts, Path(a.eval_cache), "bfloat16", a.target)
        tf = teacher_forced(target, draft, rows)
        res["teacher_forced"][kind] = {"prompts": len(rows)} | tf
        print(f"{kind}: {json.dumps(tf)}", file=sys.stderr, flush=True)
        res["engine"][kind] = engine_runs(target, draft, rows[: a.engine_prompts], a.max_new_tokens, eos)
        print(f"{kind}: {json.dumps(res['engine'][kind])}", file=sys.stderr, flush=True)
    res["cost"] = step_cost(target, draft)
    full = full_head_copy(draft)
    if full is not None:  # what the pruned output layer saves, measured the same way
        res["cost"]["full_head"] = step_cost(target, full)
    print(f"cost: {json.dumps(res['cost'])}", file=sys.stderr, flush=True)
    if a.metrics_csv and Path(a.metrics_csv).is_file():
        prior = None
        if a.prior_curve:
            prior = json.loads(Path(a.prior_curve).read_text()).get("learning_curve")
        res["learning_curve"] = learning_curve(Path(a.metrics_csv), out / "learning_curve.png", prior)
    write_text(out / "eval.json", json.dumps(res, indent=1) + "\n")
    write_text(out / "eval.md", markdown(res))
    meta_path = draft_dir / "specstop_draft.json"
    if meta_path.is_file():  # the draft carries its own measured figures
        meta = json.loads(meta_path.read_text())
        meta.setdefault("metrics", {})["heldout"] = {k: res[k] for k in ("teacher_forced", "engine", "cost")}
        from decoding.drafts.format import dumps_meta

        write_text(meta_path, dumps_meta(meta))  # the head id list stays on one line
    print(out / "eval.json")


if __name__ == "__main__":
    main()
