"""Teacher logits for distillation: the target's top-k log-probs per corpus completion token.

    python -m training.draft.teacher_cache [--corpus data/corpus] [--root .cache/teacher] [--k 64]

One bf16 teacher-forced prefill per corpus row (batched by length) gives the target's
next-token distribution at every completion position; the top-k log-probs (+ an implicit
"rest" bucket, 1 - sum of the top-k) are stored git-ignored as one safetensors file per
corpus shard under `<root>/<target name>-<fingerprint>-k<k>/<corpus dir>-<settings hash>/`.
Corpus shards never change once listed, so the cache is incremental: a shard already cached
is skipped as the corpus grows. Each file is written to a temp name and renamed (a crash
leaves no half file).

Row layout: position j of a row (0 <= j < len(completion)) is the distribution the target
predicts for completion[j] after prompt + completion[:j].
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from decoding.options import add_option

CACHE_VERSION = 1


@dataclass
class TeacherRows:
    """Teacher top-k for a list of corpus rows, concatenated; row i is offsets[i]:offsets[i+1]."""

    ids: torch.Tensor
    """[N, k] int32 token ids, most likely first."""
    logp: torch.Tensor
    """[N, k] float16 log-probs of those ids (T = 1)."""
    offsets: torch.Tensor
    """[rows + 1] int64."""

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.logp[a:b]


def cache_dir(root: str | os.PathLike, corpus: str | os.PathLike, manifest: dict, k: int) -> Path:
    """Per-(target, k, corpus) folder: a different target can never read another's logits,
    and corpora beside each other (target-written, on-policy) never share shard files."""
    def h(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]

    target = manifest["target"]
    name = str(target.get("name", "target")).replace("/", "_")
    return (Path(root) / f"{name}-{h(target)}-k{k}"
            / f"{Path(corpus).resolve().name}-{h(manifest.get('generation'))}")


def _ids_hash(prompt_ids: list[str]) -> str:
    return hashlib.sha256("\n".join(prompt_ids).encode()).hexdigest()


@torch.inference_mode()
def teacher_topk(model, seqs: list[list[int]], prompt_lens: list[int], k: int,
                 pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-k (ids int32, log-probs float32) at the completion positions of each sequence.

    Right padding with an attention mask; the output layer runs on completion positions
    only (the prompt's logits are never needed).
    """
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    dev = model.device
    hidden = model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
    spans = [(p - 1, len(s) - 1) for s, p in zip(seqs, prompt_lens)]
    rows = torch.cat([hidden[i, a:b] for i, (a, b) in enumerate(spans)])
    logp = F.log_softmax(model.lm_head(rows).float(), dim=-1)
    val, idx = logp.topk(k, dim=-1)
    out, at = [], 0
    for a, b in spans:
        out.append((idx[at: at + b - a].int().cpu(), val[at: at + b - a].cpu()))
        at += b - a
    return out


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped by similar length so that padded batches hold <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def compute_rows(model, prompts: list[list[int]], completions: list[list[int]], k: int,
                 max_tokens: int = 4096, pad_id: int = 0) -> TeacherRows:
    seqs = [p + c for p, c in zip(prompts, completions)]
    res: list = [None] * len(seqs)
    for idx in length_batches([len(s) for s in seqs], max_tokens):
        for i, r in zip(idx, teacher_topk(model, [seqs[i] for i in idx],
                                          [len(prompts[i]) for i in idx], k, pad_id)):
            res[i] = r
    offsets = torch.tensor([0] + [len(c) for c in completions]).cumsum(0)
    return TeacherRows(torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res]).half(),
                       offsets)


def _save(path: Path, rows: TeacherRows, meta: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({"ids": rows.ids.contiguous(), "logp": rows.logp.contiguous(),
                   "offsets": rows.offsets.contiguous()}, str(tmp),
                  metadata={k: json.dumps(v) for k, v in meta.items()})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path, shard: dict) -> TeacherRows:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if json.loads(meta.get("prompt_ids_sha256", "null")) != _ids_hash(shard["prompt_ids"]):
            raise ValueError(f"{path}: cached rows do not match corpus shard {shard['file']}; "
                             "delete the file to recompute it")
        return TeacherRows(f.get_tensor("ids"), f.get_tensor("logp"), f.get_tensor("offsets"))


def build_cache(corpus: str | os.PathLike, root: str | os.PathLike, k: int = 64,
                target: str | None = None, dtype: str = "bfloat16", max_tokens: int = 4096,
                teacher=None, progress: bool = True) -> Path:
    """Cache every corpus shard not cached yet; returns the cache folder."""
    import pyarrow.parquet as pq

    from training.corpus.teacher import CorpusConfig, load_teacher, read_manifest

    m = read_manifest(Path(corpus))
    if m is None:
        raise ValueError(f"{corpus}: no manifest.json: not a corpus directory")
    out = cache_dir(root, corpus, m, k)
    todo = [s for s in m["shards"] if not (out / _file(s)).exists()]
    if not todo:
        return out
    teacher = teacher or load_teacher(CorpusConfig(target=target, dtype=dtype))
    if teacher.info != m["target"]:
        raise ValueError(f"{corpus} was written by target {m['target'].get('name')} "
                         f"({m['target']}), not by the loaded one ({teacher.info})")
    out.mkdir(parents=True, exist_ok=True)
    for n, s in enumerate(todo, 1):
        t0 = time.time()
        t = pq.read_table(Path(corpus) / s["file"], columns=["prompt_ids", "completion_ids"])
        prompts, comps = t.column("prompt_ids").to_pylist(), t.column("completion_ids").to_pylist()
        rows = compute_rows(teacher.model, prompts, comps, k, max_tokens, teacher.pad_token_id)
        _save(out / _file(s), rows, {"version": CACHE_VERSION, "corpus_shard": s["file"],
                                     "prompt_ids_sha256": _ids_hash(s["prompt_ids"]),
                                     "target": m["target"], "k": k, "dtype": dtype})
        if progress:
            tok = sum(map(len, prompts)) + sum(map(len, comps))
            print(f"teacher cache: {s['file']} ({n}/{len(todo)}) {tok / (time.time() - t0):.0f} "
                  "tokens/s", file=sys.stderr, flush=True)
    return out


def _file(shard: dict) -> str:
    return Path(shard["file"]).stem + ".safetensors"


def cached_shards(corpus: str | os.PathLike, root: str | os.PathLike, k: int = 64) -> list[str]:
    """Corpus shard files that have a teacher cache file now."""
    from training.corpus.teacher import read_manifest

    m = read_manifest(Path(corpus)) or {"shards": [], "target": {}}
    folder = cache_dir(root, corpus, m, k)
    return [s["file"] for s in m["shards"] if (folder / _file(s)).exists()]


def load_cache(corpus: str | os.PathLike, root: str | os.PathLike, k: int = 64,
               partial: bool = True, only: list[str] | None = None) -> tuple[list[dict], TeacherRows]:
    """(manifest shards used, their teacher rows concatenated in shard order).

    partial: use the cached shards only (the corpus may be growing right now); otherwise a
    shard without a cache file is an error. only: restrict to these shard files.
    """
    from training.corpus.teacher import read_manifest

    m = read_manifest(Path(corpus))
    if m is None:
        raise ValueError(f"{corpus}: no manifest.json: not a corpus directory")
    folder = cache_dir(root, corpus, m, k)
    shards, parts = [], []
    for s in m["shards"]:
        path = folder / _file(s)
        if only is not None and s["file"] not in only:
            continue
        if not path.exists():
            if partial:
                continue
            raise ValueError(f"{path}: teacher cache missing; run python -m training.draft.teacher_cache")
        shards.append(s)
        parts.append(_load(path, s))
    if not parts:
        raise ValueError(f"{folder}: no cached teacher shard; run python -m training.draft.teacher_cache")
    base = torch.tensor([0] + [int(p.offsets[-1]) for p in parts]).cumsum(0)
    offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + b for p, b in zip(parts, base)])
    return shards, TeacherRows(torch.cat([p.ids for p in parts]), torch.cat([p.logp for p in parts]),
                               offsets)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.draft.teacher_cache",
                                description=__doc__.split("\n")[0])
    add_option(p, "corpus", default="data/corpus")
    add_option(p, "root", default=".cache/teacher")
    add_option(p, "k", default=64)
    add_option(p, "target")
    add_option(p, "dtype", default="bfloat16")
    add_option(p, "max_tokens", default=4096)
    add_option(p, "threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        out = build_cache(a.corpus, a.root, a.k, a.target, a.dtype, a.max_tokens)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(out)


if __name__ == "__main__":
    main()
