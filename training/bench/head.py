"""Teacher-forced agreement of a feature (EAGLE-3) head on held-out prompts, steps 1..4.

    python -m training.bench.head --ckpt runs/distill/smollm2-135m-eagle3/checkpoints/best.ckpt
    python -m training.bench.head --draft checkpoints/drafts/smollm2-135m-eagle3
    python -m training.bench.head --untrained      # the head as initialised from the target

On target continuations of the first --prompts held-out prompts per kind (general, code;
written once with the corpus settings and cached under .cache/eval_corpus/, as
training.draft.evaluate does): step j's top-1 at position t (true tokens, the head's own
features from step 2 on, as in training-time test) against the target's full-vocabulary
argmax for token t+1+j. Also the share of those argmaxes inside the draft vocabulary (the
ceiling), and sd_tokens_per_call: a greedy sd chain of 4 walked along each continuation
(rounds start after a rejection; exact on the target's greedy continuations, --greedy).
fp32 target and head. The headline figures come with 95% intervals
(bootstrap over prompts); --baseline EVAL_JSON (another head on the same prompts) adds their
paired differences, which is how two heads are compared. Writes <out>/eval.json and, with
--metrics-csv (the run's CSVLogger file), <out>/learning_curve.png (<name>_learning_curve.png
for another --name; validation agreement per
step vs minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from decoding.options import add_option

from training.shards import write_text

STEPS = 4


@torch.inference_mode()
def agreement(target, head, rows: list[dict], layers: list[int], steps: int = STEPS,
              max_tokens: int = 2048, temperature: float = 0.7, k: int = 32) -> dict:
    """Per-step top-1 agreement over every completion token of the rows (agree_stepJ), and
    chain_stepJ: the share of positions where steps 1..J ALL agree. A greedy chain of depth
    `steps` started there accepts exactly its leading run of agreeing steps (each step reads
    the true tokens, which are its own proposals once they were accepted), so the mean
    accepted length is sum_J chain_stepJ (`accepted_length`, no independence assumption;
    exact when the continuations are the target's greedy ones). `per_prompt` keeps each row's
    counts (hits, chain, n per step) for confidence intervals and paired comparisons.
    accept_stepJ: the expected acceptance of step J's one sampled draft token at `temperature`,
    sum_x min(p_T(x), q_T(x)) over the draft vocabulary with the target's p_T normalised over
    the full vocabulary (its top `k` draft tokens: a lower bound, the rest is negligible at 0.7)
    and the head's q_T; what sampled decoding gets per step, beside top-1 for greedy."""
    from training.draft.accept_metrics import walk_sd
    from training.draft.teacher_cache import length_batches
    from training.head.cache import pad_batch, target_batch
    from training.head.module import shift

    used, t2d = head.used_ids, head.t2d
    dev = used.device  # the head's (a training run's GPU): counts come back to the CPU
    hits, chain, n, accept = (torch.zeros(len(rows), steps) for _ in range(4))
    walks = torch.zeros(len(rows), 2)  # sd rounds and the tokens they commit
    inside = 0.0
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    starts = [len(r["prompt_ids"]) - 1 for r in rows]
    for idx in length_batches([len(s) for s in seqs], max_tokens):
        ids, mask = (x.to(dev) for x in pad_batch([seqs[i] for i in idx]))
        b = target_batch(target, ids, mask, torch.tensor([starts[i] for i in idx]), layers, used, k,
                         temperature=temperature)
        outs = head.unroll(ids, b["feats"], steps, mask)
        inside += float(t2d[b["top1"][b["lab_mask"]]].sum())
        run, step_hits = None, []
        for j, (lg, _) in enumerate(outs):
            m = shift(b["lab_mask"], 1 + j, False)
            hit = (used[lg.argmax(-1)] == shift(b["top1"], 1 + j, 0)) & m
            run = hit if run is None else run & hit  # position t's chain: steps 1..j+1 all right
            hits[idx, j], chain[idx, j], n[idx, j] = (x.sum(-1).float().cpu() for x in (hit, run, m))
            q = torch.log_softmax(lg.float() / temperature, -1).gather(-1, shift(b["lab_ids"], 1 + j, 0)).exp()
            p = shift(b["lab_logp"], 1 + j, float("-inf")).exp()
            accept[idx, j] = (torch.minimum(p, q).sum(-1) * m).sum(-1).cpu()
            step_hits.append(hit.cpu())
        # index t drafts x_{t+2}: the first round after prefill is t = start
        walks[idx] = walk_sd(step_hits, m.cpu(), [starts[i] for i in idx]).float()
    total = int(n[:, 0].sum())
    return {"positions": total, "target_top1_in_draft_vocab": inside / max(1, total),
            **summary(hits.sum(0), chain.sum(0), n.sum(0)),
            **{f"accept_step{j + 1}": float(accept[:, j].sum() / n[:, j].sum().clamp_min(1)) for j in range(steps)},
            "accept_temperature": temperature,
            "sd_tokens_per_call": float(walks[:, 1].sum() / walks[:, 0].sum().clamp_min(1)),
            "per_prompt": {"prompt_ids": [r.get("prompt_id") for r in rows], "hits": hits.tolist(),
                           "chain": chain.tolist(), "n": n.tolist(), "accept": accept.tolist(),
                           "rounds": walks[:, 0].tolist(),
                           "round_tokens": walks[:, 1].tolist()}}


def summary(hits, chain, n) -> dict:
    """agree_stepJ, chain_stepJ and accepted_length from summed counts (one value per step)."""
    hits, chain, n = (torch.as_tensor(x, dtype=torch.float64) for x in (hits, chain, n))
    per = chain / n.clamp_min(1)
    return {**{f"agree_step{j + 1}": float(hits[j] / n[j].clamp_min(1)) for j in range(len(n))},
            **{f"chain_step{j + 1}": float(per[j]) for j in range(len(n))},
            "accepted_length": float(per.sum())}


HEADLINE = ("agree_step1", "accepted_length", "sd_tokens_per_call", "accept_step1")
LATER = {"sd_tokens_per_call": "rounds", "accept_step1": "accept"}
"""Headline figures older results lack, and the per-prompt count each needs."""


def _counts(res: dict) -> np.ndarray:
    """[prompts, 4 * steps + 2]: hits, chain, n and expected acceptance per step, then sd
    rounds and their tokens (zeros in results written before those were counted)."""
    pp = res["per_prompt"]
    zeros = np.zeros_like(np.asarray(pp["n"], dtype=np.float64))
    walks = [pp.get(k, [0.0] * len(pp["n"])) for k in ("rounds", "round_tokens")]
    return np.concatenate([np.asarray(pp[k], dtype=np.float64) for k in ("hits", "chain", "n")]
                          + [np.asarray(pp["accept"], dtype=np.float64) if "accept" in pp else zeros]
                          + [np.asarray(walks, dtype=np.float64).T], 1)


def _headline(c: np.ndarray) -> np.ndarray:
    """[draws, 4]: step-1 agreement, accepted length, sd tokens per call and step-1 expected
    acceptance from summed counts."""
    s = (c.shape[1] - 2) // 4
    hits, chain, n, acc = c[:, :s], c[:, s: 2 * s], np.maximum(c[:, 2 * s: 3 * s], 1), c[:, 3 * s: 4 * s]
    return np.stack([hits[:, 0] / n[:, 0], (chain / n).sum(1), c[:, -1] / np.maximum(c[:, -2], 1),
                     acc[:, 0] / n[:, 0]], 1)


def bootstrap(res: dict, base: dict | None = None, resamples: int = 2000, seed: int = 0) -> dict:
    """95% intervals by a bootstrap over prompts: of this head's headline figures, or (base
    given, measured on the same prompts) of their differences from the base head's, paired
    (the same draw for both heads)."""
    c = _counts(res)
    if base is not None:
        if base["per_prompt"]["prompt_ids"] != res["per_prompt"]["prompt_ids"]:
            raise ValueError("the baseline was measured on other prompts: compare on the same ones")
        c = np.concatenate([c, _counts(base)], 1)
    from decoding.bench.stats import resample_weights

    def stat(x):
        if base is None:
            return _headline(x)
        half = x.shape[1] // 2
        return _headline(x[:, :half]) - _headline(x[:, half:])

    point, vals = stat(c.sum(0, keepdims=True))[0], stat(resample_weights(len(c), resamples, seed) @ c)
    lo, hi = np.quantile(vals, [0.025, 0.975], axis=0)
    have = [r["per_prompt"] for r in (res, base) if r is not None]
    return {k: [float(point[i]), float(lo[i]), float(hi[i])] for i, k in enumerate(HEADLINE)
            if k not in LATER or all(LATER[k] in pp for pp in have)}


def baseline(path: str) -> dict:
    """The teacher_forced section of an earlier eval json that kept per-prompt counts."""
    res = json.loads(Path(path).read_text())
    tf = res.get("teacher_forced") if isinstance(res, dict) else None
    if not isinstance(tf, dict) or not tf or any(not isinstance(v, dict) or "per_prompt" not in v
                                                   for v in tf.values()):
        raise ValueError(f"{path}: not a training.bench.head result with per-prompt counts")
    return tf


def learning_curve(csv: Path, png: Path, steps: int = STEPS) -> list[dict]:
    """Validation agreement of steps 1..steps vs training minutes, from a run's metrics.csv."""
    import pandas as pd

    df = pd.read_csv(csv)
    if "val/agree_1" not in df:
        return []
    v = df[df["val/agree_1"].notna()]
    cols = ["step", "train_minutes"] + [c for j in range(1, steps + 1)
                                         for c in (f"val/agree_{j}", f"val/agree_{j}_general",
                                                   f"val/agree_{j}_code") if c in v]
    pts = [{k: float(x) for k, x in r.items()} for r in v[cols].to_dict("records")]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for j in range(1, steps + 1):
        if f"val/agree_{j}" in v:
            ax.plot([p["train_minutes"] for p in pts], [p[f"val/agree_{j}"] for p in pts],
                    marker="o", ms=3, label=f"step {j}")
    ax.set_xlabel("training wall-clock minutes (shared 2-core CPU)")
    ax.set_ylabel("top-1 agreement (validation slice of the corpus)")
    ax.axhline(0.75, ls="--", c="grey", lw=1, label="goal step 1: 0.75")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return pts


def train_speed(module, batches: list[dict], online: bool) -> dict:
    """Training positions/s (forward, backward, AdamW step) over the same batches, with the
    target's states read from the cache or computed by a prefill inside each step."""
    opt = torch.optim.AdamW(module.head.parameters(), lr=1e-5)
    pos = secs = 0.0
    for n, b in enumerate(batches):
        if online:
            b = {k: v for k, v in b.items()
                 if k in ("input_ids", "attention_mask", "code", "label_start")}
        t0 = time.perf_counter()
        loss, _ = module._step(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if n:  # the first batch warms up
            secs += time.perf_counter() - t0
            pos += float(b["attention_mask"].sum())
    return {"batches": len(batches) - 1, "positions": int(pos), "positions_per_s": pos / secs}


def speed(a) -> dict:
    """Cached vs online feature source, same batches, this machine, --threads threads."""
    from itertools import islice

    from training.head.data import FeatureDataModule
    from training.head.module import FeatureDistillModule

    dm = FeatureDataModule(cache_root=a.cache_root, draft_vocab_size=a.vocab_size,
                           build_cache=False, max_tokens=a.max_tokens)
    dm.setup("fit")
    module = FeatureDistillModule(steps=a.steps)
    module.build_head(dm.layers, dm.vocab.used)
    module.online_k = dm.k
    batches = list(islice(iter(dm.train_dataloader()), a.batches + 1))
    out = {"steps": a.steps, "max_tokens": dm.max_tokens, "threads": torch.get_num_threads()}
    for name, online in (("cached", False), ("online", True)):
        out[name] = train_speed(module, batches, online)
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return out


def load_head(a, target):
    """The head to measure: a Lightning checkpoint, an exported directory, or untrained."""
    if a.ckpt:
        from training.head.module import load_feature_module

        m = load_feature_module(a.ckpt)
        return m.head.float().eval(), list(m.head.config.aux_layers)
    if a.draft:
        from decoding.drafts import io as feature_io

        head = feature_io.load_feature_draft(a.draft, target)
        return head.float().eval(), list(head.config.aux_layers)
    from training.head.cache import CacheSettings, default_layers, open_cache
    from training.head.module import FeatureDistillModule
    from training.corpus.teacher import target_fingerprint

    layers = default_layers(target.config.num_hidden_layers)
    s = CacheSettings(layers, a.vocab_size, 32, 256)
    _, vocab = open_cache(a.cache_root, target_fingerprint(None), s,
                          ["data/corpus", "data/corpus-onpolicy"])
    m = FeatureDistillModule()
    m._target.append(target)
    return m.build_head(layers, vocab.used).float().eval(), layers


def step_cost(target, head, rounds: int = 5, context: int = 256) -> dict:
    """The head's step (1 node, and a 4-node level) as a share of the target's 1-token step,
    both timed in this process, alternating (decoding.forward.cost.time_forwards), medians."""
    import numpy as np

    from decoding.forward.cost import time_forwards

    t, h1, h4 = [], [], []
    for _ in range(rounds):
        t += time_forwards(target, [1], repeats=3, context=context)
        a, b = time_forwards(head, [1, 4], repeats=3, context=context)
        h1.append(a)
        h4.append(b)
    tm, m1, m4 = (float(np.median(x)) for x in (t, h1, h4))
    return {"context": context, "target_step_ms": tm, "head_step_ms": m1, "head_level4_ms": m4,
            "head_step_share": m1 / tm, "head_level4_share": m4 / tm}


def main(argv: list[str] | None = None) -> None:
    from decoding.models import ModelError, load_model, weights_sample_sha256

    from training.draft.evaluate import KINDS, PROMPT_SETS, eval_corpus

    p = argparse.ArgumentParser(prog="python -m training.bench.head",
                                description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    add_option(g, "ckpt")
    add_option(g, "draft", unset="--ckpt's")
    g.add_argument("--untrained", action="store_true", help="the head as initialised")
    g.add_argument("--speed", action="store_true",
                   help="training positions/s, cached vs online source -> <out>/throughput.json")
    p.add_argument("--batches", type=int, default=4, help="--speed: timed batches per source")
    p.add_argument("--steps", type=int, default=5, help="--speed: training-time-test steps")
    add_option(p, "max_tokens", default=1024)
    p.add_argument("--vocab-size", type=int, default=8192, help="--untrained: draft vocab size")
    p.add_argument("--cache-root", default=".cache/features")
    add_option(p, "out", default="reports/draft/feature")
    add_option(p, "name", default="eval")
    add_option(p, "prompts", default=40)
    p.add_argument("--baseline", default=None,
                   help="an earlier eval json on the same prompts: paired differences with 95%% CIs")
    add_option(p, "metrics_csv")
    add_option(p, "eval_cache")
    p.add_argument("--greedy", action="store_true",
                   help="on the target's greedy continuations (written once): sd_tokens_per_call is then "
                        "exactly what a greedy sd chain of 4 commits per target call; default T=0.7 ones")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"held-out prompt sets, comma-separated: {', '.join(PROMPT_SETS)}")
    add_option(p, "threads")
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not kinds or any(k not in PROMPT_SETS for k in kinds):
        raise SystemExit(f"error: --kinds takes {', '.join(PROMPT_SETS)} (got {a.kinds!r})")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.speed:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        res = speed(a) | {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        write_text(out / "throughput.json", json.dumps(res, indent=1) + "\n")
        return print(out / "throughput.json")
    for f in (a.ckpt, a.metrics_csv, a.baseline):
        if f and not Path(f).is_file():
            raise SystemExit(f"error: file not found: {f}")
    try:
        base = baseline(a.baseline) if a.baseline else None
        target = load_model(None, "float32")
        head, layers = load_head(a, target)
    except (ModelError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"error: {e}") from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"head": a.ckpt or a.draft or "untrained", "weights_sha256": weights_sample_sha256(head),
           "dtype": "float32", "layers": layers,
           "continuations": "greedy" if a.greedy else "T=0.7",
           "threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "teacher_forced": {}}
    for kind in kinds:
        if base is not None and kind not in base:
            raise SystemExit(f"error: {a.baseline}: has no {kind} prompts (measure it with --kinds {kind})")
        rows = eval_corpus(kind, a.prompts, Path(a.eval_cache), "bfloat16", temperature=0.0 if a.greedy else 0.7)
        if base is not None and base[kind]["per_prompt"]["prompt_ids"] != [x["prompt_id"] for x in rows]:
            raise SystemExit(f"error: {a.baseline}: measured on other {kind} prompts (use its --prompts)")
        r = res["teacher_forced"][kind] = {"prompts": len(rows)} | agreement(target, head, rows, layers)
        r["ci95"] = bootstrap(r)
        if base is not None:
            r["vs_baseline"] = {"baseline": a.baseline} | bootstrap(r, base[kind])
        shown = {k: v for k, v in r.items() if k != "per_prompt"}
        print(f"{kind}: {json.dumps(shown)}", file=sys.stderr, flush=True)
    if not a.untrained:
        res["cost"] = step_cost(target, head)
        print(f"cost: {json.dumps(res['cost'])}", file=sys.stderr, flush=True)
    if a.metrics_csv:
        png = "learning_curve.png" if a.name == "eval" else f"{a.name}_learning_curve.png"
        res["learning_curve"] = learning_curve(Path(a.metrics_csv), out / png)
    write_text(out / f"{a.name}.json", json.dumps(res, indent=1) + "\n")
    print(out / f"{a.name}.json")


if __name__ == "__main__":
    main()
