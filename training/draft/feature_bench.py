"""Teacher-forced agreement of a feature (EAGLE-3) head on held-out prompts, steps 1..4.

    python -m training.draft.feature_bench --ckpt runs/distill/smollm2-135m-eagle3/checkpoints/best.ckpt
    python -m training.draft.feature_bench --draft checkpoints/drafts/smollm2-135m-eagle3
    python -m training.draft.feature_bench --untrained      # the head as initialised from the target

On target continuations of the first --prompts held-out prompts per kind (general, code;
written once with the corpus settings and cached under .cache/eval_corpus/, as
training.distill_eval does): step j's top-1 at position t (true tokens, the head's own
features from step 2 on, as in training-time test) against the target's full-vocabulary
argmax for token t+1+j. Also the share of those argmaxes inside the draft vocabulary (the
ceiling). fp32 target and head. Writes <out>/eval.json and, with --metrics-csv (the run's
CSVLogger file), <out>/learning_curve.png (validation agreement per step vs minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

STEPS = 4


@torch.inference_mode()
def agreement(target, head, rows: list[dict], layers: list[int], steps: int = STEPS,
              max_tokens: int = 2048) -> dict:
    """Per-step top-1 agreement over every completion token of the rows."""
    from .feature_cache import _batches, pad_batch, target_batch
    from .feature_module import shift

    used = head.d2t + torch.arange(len(head.d2t))
    t2d = head.t2d
    hits, n, inside = torch.zeros(steps), torch.zeros(steps), 0.0
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    starts = [len(r["prompt_ids"]) - 1 for r in rows]
    for idx in _batches([len(s) for s in seqs], max_tokens):
        ids, mask = pad_batch([seqs[i] for i in idx])
        b = target_batch(target, ids, mask, torch.tensor([starts[i] for i in idx]), layers, used, 1)
        logits = head.unroll(b["feats"], ids, mask, steps)
        inside += float(t2d[b["top1"][b["lab_mask"]]].sum())
        for j, lg in enumerate(logits):
            m = shift(b["lab_mask"], 1 + j, False)
            top1 = shift(b["top1"], 1 + j, 0)[m]
            hits[j] += float((used[lg[m].argmax(-1)] == top1).sum())
            n[j] += int(m.sum())
    return {"positions": int(n[0]), "target_top1_in_draft_vocab": inside / max(1, int(n[0])),
            **{f"agree_step{j + 1}": float(hits[j] / n[j].clamp_min(1)) for j in range(steps)}}


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


def load_head(a, target):
    """The head to measure: a Lightning checkpoint, an exported directory, or untrained."""
    if a.ckpt:
        from .feature_train import load_feature_module

        m = load_feature_module(a.ckpt)
        return m.head.float().eval(), list(m.head.config.aux_layers)
    if a.draft:
        from decoding import feature_io

        head = feature_io.load_feature_draft(a.draft, target)
        return head.float().eval(), list(head.config.aux_layers)
    from .feature_cache import CacheSettings, default_layers, open_cache
    from .feature_module import FeatureDistillModule
    from ..distill import target_fingerprint

    layers = default_layers(target.config.num_hidden_layers)
    s = CacheSettings(layers, a.vocab_size, 32, 256)
    _, vocab = open_cache(a.cache_root, target_fingerprint(None), s,
                          ["data/corpus", "data/corpus-onpolicy"])
    m = FeatureDistillModule()
    m._target.append(target)
    return m.build_head(layers, vocab.used).float().eval(), layers


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    from decoding.models import ModelError, load_model

    from ..distill_eval import KINDS, eval_corpus

    p = argparse.ArgumentParser(prog="python -m training.draft.feature_bench",
                                description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--ckpt", help="Lightning checkpoint of a feature-head run")
    g.add_argument("--draft", help="exported feature-head directory")
    g.add_argument("--untrained", action="store_true", help="the head as initialised")
    p.add_argument("--vocab-size", type=int, default=8192, help="--untrained: draft vocab size")
    p.add_argument("--cache-root", default=".cache/features")
    p.add_argument("--out", default="reports/draft/feature")
    p.add_argument("--name", default="eval", help="writes <out>/<name>.json")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per kind")
    p.add_argument("--metrics-csv", default=None, help="the run's metrics.csv (learning curve)")
    p.add_argument("--eval-cache", default=".cache/eval_corpus")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    for f in (a.ckpt, a.metrics_csv):
        if f and not Path(f).is_file():
            raise SystemExit(f"error: file not found: {f}")
    try:
        target = load_model(None, "float32")
        head, layers = load_head(a, target)
    except (ModelError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"head": a.ckpt or a.draft or "untrained", "dtype": "float32", "layers": layers,
           "threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "teacher_forced": {}}
    for kind in KINDS:
        rows = eval_corpus(kind, a.prompts, Path(a.eval_cache), "bfloat16")
        res["teacher_forced"][kind] = {"prompts": len(rows)} | agreement(target, head, rows, layers)
        print(f"{kind}: {json.dumps(res['teacher_forced'][kind])}", file=sys.stderr, flush=True)
    if a.metrics_csv:
        res["learning_curve"] = learning_curve(Path(a.metrics_csv), out / "learning_curve.png")
    _write(out / f"{a.name}.json", json.dumps(res, indent=1) + "\n")
    print(out / f"{a.name}.json")


if __name__ == "__main__":
    main()
