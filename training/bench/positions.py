"""How a feature head holds up with context: step-1 acceptance by position bucket.

    python -m training.bench.positions --draft checkpoints/drafts/smollm2-135m-eagle3 \
        --corpus data/corpus-chat [--rows 64] [--edges 0 256 512 1024 2048 4096 8192]

An exported head promises the target's positions (8,192 for SmolLM2) while it was trained on
windows of at most `trained_window` tokens (recorded in its training metadata). This reads
validation rows of a corpus (training.draft.data.is_val) WHOLE, their prompt never cut, and
buckets every completion token by the context the target had when it predicted it (tokens
before it): per bucket, teacher-forced step-1 top-1 agreement with the target's argmax and
the expected acceptance sum min(p, q) at --temperature (training.draft.accept_metrics), fp32.
Writes <out>/positions.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decoding.options import add_option

EDGES = (0, 256, 512, 1024, 2048, 4096, 8192)


@torch.inference_mode()
def by_position(target, head, seqs: list[list[int]], starts: list[int], layers: list[int],
                edges=EDGES, temperature: float = 0.7, max_tokens: int = 4096) -> list[dict]:
    """Per bucket [edges[i], edges[i+1]) of context length: positions, step-1 agreement and
    expected acceptance. starts[i]: index of the last prompt token of row i."""
    from training.draft.accept_metrics import expected_acceptance
    from training.draft.teacher_cache import length_batches
    from training.head.cache import pad_batch, target_batch
    from training.head.module import shift

    used = head.used_ids
    edges = torch.tensor([*edges, 1 << 62])
    n, hit, acc = (torch.zeros(len(edges) - 1, dtype=torch.float64) for _ in range(3))
    for idx in length_batches([len(s) for s in seqs], max_tokens):
        ids, mask = pad_batch([seqs[i] for i in idx])
        b = target_batch(target, ids, mask, torch.tensor([starts[i] for i in idx]), layers, used, 32)
        (lg, _), = head.unroll(ids, b["feats"], 1, mask)
        m = shift(b["lab_mask"], 1, False)  # index t drafts the token at t + 2 from label t + 1
        ok = (used[lg.argmax(-1)] == shift(b["top1"], 1, 0))[m].double()
        a = expected_acceptance(shift(b["lab_ids"], 1, 0)[m], shift(b["lab_logp"], 1, float("-inf"))[m],
                                torch.log_softmax(lg[m].float(), -1), temperature).double()
        ctx = (torch.arange(ids.shape[1]) + 2).expand_as(m)[m]  # tokens before the drafted one
        bucket = torch.bucketize(ctx, edges, right=True) - 1
        n += torch.bincount(bucket, minlength=len(n)).double()
        hit += torch.bincount(bucket, ok, minlength=len(n))
        acc += torch.bincount(bucket, a, minlength=len(n))
    return [{"from": int(edges[i]), "to": int(edges[i + 1]) if i + 2 < len(edges) else None,
             "positions": int(n[i]), "agree_step1": float(hit[i] / n[i]) if n[i] else None,
             f"accept_T{temperature:g}": float(acc[i] / n[i]) if n[i] else None}
            for i in range(len(n))]


def val_rows(corpus: str, rows: int, val_percent: float) -> tuple[list[list[int]], list[int]]:
    from training.corpus.teacher import load_corpus
    from training.draft.data import is_val

    seqs, starts = [], []
    for r in load_corpus(corpus).to_list():
        if is_val(r["prompt_id"], val_percent) and len(seqs) < rows:
            seqs.append(r["prompt_ids"] + r["completion_ids"])
            starts.append(len(r["prompt_ids"]) - 1)
    return seqs, starts


def main(argv: list[str] | None = None) -> None:
    from decoding.drafts import io as feature_io
    from decoding.models import ModelError, load_model

    p = argparse.ArgumentParser(prog="python -m training.bench.positions",
                                description=__doc__.split("\n")[0])
    add_option(p, "draft", required=True)
    add_option(p, "corpus", required=True)
    add_option(p, "target")
    p.add_argument("--rows", type=int, default=64)
    add_option(p, "val_percent")
    p.add_argument("--edges", type=int, nargs="+", default=list(EDGES))
    add_option(p, "temperature", default=0.7)
    add_option(p, "threads")
    add_option(p, "out")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if sorted(set(a.edges)) != a.edges or a.edges[0] != 0:
        raise SystemExit("error: --edges must rise strictly from 0")
    try:
        target = load_model(a.target, "float32")
        head = feature_io.load_feature_draft(a.draft, target).float().eval()
        seqs, starts = val_rows(a.corpus, a.rows, a.val_percent)
    except (ModelError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if not seqs:
        raise SystemExit(f"error: {a.corpus}: no validation rows at --val-percent {a.val_percent}")
    res = by_position(target, head, seqs, starts, list(head.config.aux_layers), a.edges,
                      a.temperature)
    out = {"draft": a.draft, "corpus": a.corpus, "rows": len(seqs), "buckets": res}
    if a.out:
        from training import shards

        Path(a.out).mkdir(parents=True, exist_ok=True)
        shards.write_json(Path(a.out) / "positions.json", out)
    for b in res:
        print(json.dumps(b))


if __name__ == "__main__":
    main()
