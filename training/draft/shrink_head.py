"""Shrink a draft's output layer to its N most frequent ids, without training (as FR-Spec).

    python -m training.draft.shrink_head --draft checkpoints/drafts/smollm2-135m-draft --size 12288 \
        --out checkpoints/drafts/smollm2-135m-draft-h12k [--corpus data/corpus ...]

The draft's step cost grows with the ids its head scores (a [hidden, N] product per step,
memory-bound on CPU); most of them are rarely the target's choice. The kept ids are the
draft's current ones ranked by how often the target wrote them in target-written corpora
(a sample of what the draft must predict), plus BOS/EOS. With tied embeddings the head is a
row selection of the embedding: the kept ids' logits are unchanged, the others can no longer
be proposed. Which is cheaper overall is an empirical question: measure with
`training.bench.draft_cost` and `training.draft.evaluate`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from decoding.options import add_option



def corpus_counts(corpora: list[str]) -> Counter:
    """Token frequencies of the completions of target-written corpora (on-policy ones refused)."""
    from training.corpus.teacher import load_corpus, read_manifest

    c: Counter = Counter()
    for corpus in corpora:
        m = read_manifest(Path(corpus))
        if m is None:
            raise ValueError(f"{corpus}: no manifest.json: not a corpus directory")
        if m["generation"].get("on_policy"):
            raise ValueError(f"{corpus}: written by a draft; rank the head by target-written text")
        for ids in load_corpus(Path(corpus))["completion_ids"]:
            c.update(ids)
    return c


def shrink(model, size: int, counts: Counter) -> dict:
    """Keep `size` of the draft's head ids (most frequent first, BOS/EOS always); in place."""
    from decoding.models import ModelError, output_token_ids

    from training.draft.module import select_head_ids

    ids = output_token_ids(model)
    if ids is None:
        raise ModelError("the draft has a full output layer (no head_size): nothing to shrink")
    if not 0 < size < ids.numel():
        raise ModelError(f"--size must be below the current head size {ids.numel()} (got {size})")
    conf = model.config
    eos = conf.eos_token_id
    always = {conf.bos_token_id, *([eos] if isinstance(eos, int) else eos or [])} - {None}
    current = ids.tolist()
    kept = select_head_ids(counts, conf.vocab_size, size, always, among=current)
    total = sum(counts.values())
    before = sum(counts[t] for t in current) / max(1, total)
    model.set_head_ids(kept, resize=True)
    return {"from": int(ids.numel()), "to": int(kept.numel()),
            "corpus_coverage_before": round(before, 5),
            "corpus_coverage_after": round(sum(counts[t] for t in kept.tolist()) / max(1, total), 5)}


def main(argv: list[str] | None = None) -> None:
    from decoding.models import ModelError, load_model, resolve_model_dir

    from training.draft.distill import METADATA, write_draft
    from training.shards import sha256_file

    p = argparse.ArgumentParser(prog="python -m training.draft.shrink_head", description=__doc__.split("\n")[0])
    add_option(p, "draft", required=True)
    add_option(p, "size", required=True)
    add_option(p, "out", required=True)
    add_option(p, "corpus", several=True, default=["data/corpus"])
    add_option(p, "dtype", default="bfloat16", only=("bfloat16", "float16"))
    a = p.parse_args(argv)
    try:
        src = resolve_model_dir(a.draft)
        if Path(a.out).resolve() == src.resolve():
            raise ModelError("--out must differ from --draft (the source stays as it is)")
        model = load_model(src, a.dtype)
        counts = corpus_counts(a.corpus)
        info = shrink(model, a.size, counts)
    except (ModelError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    meta_path = src / METADATA
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    info |= {"source": a.draft, "ranked_by": {c: sha256_file(Path(c) / "manifest.json")
                                              for c in a.corpus}}
    # training's validation figures were measured with the larger head: kept, and labelled;
    # held-out ones are dropped (training.draft.evaluate measures the new draft again)
    metrics = meta.setdefault("metrics", {})
    info["validation_metrics_before_shrinking"] = "validation" in metrics
    metrics.pop("heldout", None)
    meta["draft"] = meta.get("draft", {}) | {"head_size": info["to"]}
    meta["head_shrunk"] = info
    write_draft(model, Path(a.out), meta, src, a.dtype)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
