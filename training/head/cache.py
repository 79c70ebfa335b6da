"""The target's three-layer states and soft labels for training a feature (EAGLE-3) head.

    python -m training.head.cache [--corpus data/corpus data/corpus-onpolicy]
        [--root .cache/features] [--size 8192] [--k 32] [--threads 2] [--max-minutes M]

One fp32 prefill per corpus row (batched by length; bf16 is slower on this AVX2 CPU) with
`capture_aux` pre-hooks gives, at every position of prompt[-max_prompt_tokens:] + completion,
the residual stream at the input of the three aux layers ([T, 3H], float16; bfloat16 where float16
overflows, as Gemma's does) and, at
every position that predicts a completion token, the target's top-k log-probs over the
draft vocabulary (log-softmax of the target logits restricted to it, ids as draft indices)
plus the target's full-vocabulary argmax (the loss is masked where it is outside the draft
vocabulary). Layout, git-ignored:

    <root>/<target>-<fingerprint>-<settings>/   manifest.json, vocab.safetensors (`used` ids)
        <corpus dir>-<generation hash>/shard-NNNNN.safetensors   (one per corpus shard)

The vocabulary is chosen once, at the first build, and kept as the corpora grow (labels stay
valid); re-distilling a head passes its own vocabulary instead (`vocab`: the same folder when
it matches, else a sibling `<folder>-v<vocab hash>`). Corpus shards never change once listed,
so a shard already cached is skipped (incremental, resumable). Every file is written to a
temp name and renamed. A fresh machine rebuilds all of it from the committed corpora (about
3.5 kB per position).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from decoding.options import add_option

from training.draft.teacher_cache import length_batches  # rows grouped by length, padded batches <= max_tokens
from training.head.vocab import DraftVocab, build_vocab, fixed_vocab

CACHE_VERSION = 1
MANIFEST_KIND = "specstop-feature-cache"


@dataclass
class CacheSettings:
    layers: list[int]
    """Target layers whose INPUT (pre-norm residual stream) is captured."""
    draft_vocab_size: int = 8192
    """Ids of the draft vocabulary (the target's most frequent completion tokens)."""
    k: int = 32
    """Top-k draft-vocabulary log-probs kept per labelled position."""
    max_prompt_tokens: int = 256
    """Prompt context kept before each completion (the head attends over it)."""


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def cache_root(root, target: dict, settings: CacheSettings) -> Path:
    name = str(target.get("name", "target")).replace("/", "_")
    return Path(root) / f"{name}-{_h(target)}-{_h(asdict(settings))}"


def shard_dir(folder: Path, corpus, manifest: dict) -> Path:
    return folder / f"{Path(corpus).resolve().name}-{_h(manifest.get('generation'))}"


def _file(shard: dict) -> str:
    return Path(shard["file"]).stem + ".safetensors"


def _ids_hash(prompt_ids: list[str]) -> str:
    return hashlib.sha256("\n".join(prompt_ids).encode()).hexdigest()


def default_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers (2, L//2, L-3), the serving engines' default."""
    from decoding.drafts.feature import default_aux_layers

    return list(default_aux_layers(n_layers))


# --- the prefill ------------------------------------------------------------------------------
def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()  # not inference_mode: online training saves these for backward
def target_batch(model, ids: torch.Tensor, mask: torch.Tensor, label_start: torch.Tensor,
                 layers: list[int], used: torch.Tensor, k: int, chunk: int = 1024,
                 temperature: float | None = None) -> dict:
    """Features and soft labels of a right-padded batch, dense over positions.

    feats [B, W, 3H] float32; lab_ids [B, W, k] draft indices; lab_logp [B, W, k] float32;
    top1 [B, W] the target's argmax id; lab_mask [B, W]: position t predicts a completion
    token (label_start[b] <= t < length - 1). With `temperature`, lab_logp are log p_T over the
    FULL vocabulary (not renormalised over the draft's: exact expected acceptance, training.bench.head).
    """
    from decoding.drafts.capture import capture_aux
    from decoding.models.target_layout import target_layout

    layout = target_layout(model)
    with capture_aux(model, layers) as cap:
        hidden = layout.trunk(input_ids=ids, attention_mask=mask).last_hidden_state
    feats = cap.aux().float()
    b, w = ids.shape
    dev = ids.device  # a GPU run's batches: every output on the batch's device
    t = torch.arange(w, device=dev)
    label_start = label_start.to(dev)
    lab_mask = (t[None] >= label_start[:, None]) & (t[None] < mask.sum(-1, keepdim=True) - 1)
    rows = hidden[lab_mask]
    lab_ids = torch.zeros(b, w, k, dtype=torch.long, device=dev)
    lab_logp = torch.full((b, w, k), float("-inf"), device=dev)
    top1 = torch.zeros(b, w, dtype=torch.long, device=dev)
    li, lp, t1 = [], [], []
    for a in range(0, len(rows), chunk):  # full-vocabulary logits are big: a chunk at a time
        logits = layout.logits(rows[a: a + chunk]).float()
        t1.append(logits.argmax(-1))
        if temperature is None:
            val, idx = F.log_softmax(logits[:, used], -1).topk(min(k, len(used)), -1)
        else:
            val, idx = F.log_softmax(logits / temperature, -1)[:, used].topk(min(k, len(used)), -1)
        li.append(idx)
        lp.append(val)
    if rows.shape[0]:
        kk = li[0].shape[-1]
        lab_ids[lab_mask, :kk], lab_logp[lab_mask, :kk] = torch.cat(li), torch.cat(lp)
        top1[lab_mask] = torch.cat(t1)
    return {"feats": feats, "lab_ids": lab_ids, "lab_logp": lab_logp, "top1": top1,
            "lab_mask": lab_mask}


def rows_of_shard(prompts: list[list[int]], comps: list[list[int]], max_prompt_tokens: int):
    """(sequences, label starts): the last max_prompt_tokens prompt tokens + the completion."""
    seqs, starts = [], []
    for p, c in zip(prompts, comps):
        p = p[-max_prompt_tokens:] if max_prompt_tokens else p
        seqs.append(p + c)
        starts.append(len(p) - 1)
    return seqs, starts


def compute_shard(model, seqs: list[list[int]], starts: list[int], settings: CacheSettings,
                  used: torch.Tensor, pad_id: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Flat tensors of a list of rows: row i's positions are offsets[i]:offsets[i+1] and its
    labelled positions lab_offsets[i]:lab_offsets[i+1] (starting at label_start[i])."""
    per: list = [None] * len(seqs)
    for idx in length_batches([len(s) for s in seqs], max_tokens):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id)
        out = target_batch(model, ids, mask, torch.tensor([starts[i] for i in idx]),
                           settings.layers, used, settings.k)
        for j, i in enumerate(idx):
            n, m = len(seqs[i]), out["lab_mask"][j]
            per[i] = (out["feats"][j, :n], out["lab_ids"][j][m], out["lab_logp"][j][m], out["top1"][j][m])
    feats = torch.cat([p[0] for p in per])
    # float16 keeps 3 more mantissa bits, but Gemma's residual stream exceeds its range: bfloat16
    # there (per shard; readers upcast every row to float32)
    half = feats.half()
    return {"ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "feats": half if torch.isfinite(half).all() else feats.bfloat16(),
            "offsets": torch.tensor([0] + [len(s) for s in seqs]).cumsum(0),
            "label_start": torch.tensor(starts, dtype=torch.long),
            "lab_ids": torch.cat([p[1] for p in per]).int(),
            "lab_logp": torch.cat([p[2] for p in per]).half(),
            "top1": torch.cat([p[3] for p in per]).int(),
            "lab_offsets": torch.tensor([0] + [len(p[3]) for p in per]).cumsum(0)}


# --- the cache --------------------------------------------------------------------------------
def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _stored_vocab(folder: Path) -> torch.Tensor | None:
    f = folder / "vocab.safetensors"
    return load_file(str(f))["used"].long() if f.exists() else None


def open_cache(root, target: dict, settings: CacheSettings, corpora: list[str],
               always: set[int] = frozenset(), vocab: torch.Tensor | None = None
               ) -> tuple[Path, DraftVocab]:
    """The cache folder for (target, settings) with its vocabulary: chosen from the corpora on
    first use, or `vocab` (fixed target ids, e.g. the head's own when it is re-distilled).
    Labels are valid for one vocabulary only, so a fixed one that differs from the folder's
    gets a sibling folder named by its hash (a head trained on this cache finds it here)."""
    folder = cache_root(root, target, settings)
    fixed = None
    if vocab is not None:
        fixed = fixed_vocab(vocab, int(target["vocab_size"]), settings.draft_vocab_size)
        held = _stored_vocab(folder)
        if held is not None and not torch.equal(held, fixed.used):
            folder = folder.with_name(f"{folder.name}-v{fixed.sha256()}")
    vfile, man = folder / "vocab.safetensors", folder / "manifest.json"
    if vfile.exists():
        used = _stored_vocab(folder)
        if fixed is not None and not torch.equal(used, fixed.used):
            raise ValueError(f"{folder}: holds another vocabulary than the fixed one; delete it")
        cover = json.loads(man.read_text()).get("vocab_coverage") if man.exists() else None
        vocab = DraftVocab(used, int(target["vocab_size"]), cover)
    else:
        vocab = (build_vocab(corpora, settings.draft_vocab_size, always) if fixed is None else
                 fixed_vocab(fixed.used, fixed.target_vocab, settings.draft_vocab_size, corpora))
        folder.mkdir(parents=True, exist_ok=True)
        _atomic(vfile, lambda p: save_file({"used": vocab.used}, str(p)))
    if not man.exists():
        body = {"kind": MANIFEST_KIND, "version": CACHE_VERSION, "target": target,
                "settings": asdict(settings), "vocab_sha256": vocab.sha256(),
                "vocab_coverage": vocab.coverage, "dtype": "float32"}
        _atomic(man, lambda p: p.write_text(json.dumps(body, indent=1) + "\n"))
    else:
        m = json.loads(man.read_text())
        if m.get("target") != target or m.get("version") != CACHE_VERSION:
            raise ValueError(f"{folder}: cache written for another target or version; delete it")
    return folder, vocab


def build(corpora: list[str], root, settings: CacheSettings, teacher, max_tokens: int = 4096,
          max_minutes: float | None = None, progress: bool = True,
          vocab: torch.Tensor | None = None) -> tuple[Path, DraftVocab]:
    """Cache every corpus shard not cached yet (up to max_minutes); returns (folder, vocab).
    `vocab`: fixed draft-vocabulary ids (see open_cache)."""
    from tqdm import tqdm

    from training.corpus.tokens import any_manifest as read_manifest, columns
    from training.head.vocab import special_ids

    mans = {}
    for c in corpora:
        m = read_manifest(Path(c))
        if m is None:
            raise ValueError(f"{c}: no manifest.json: not a corpus directory")
        if m["target"] != teacher.info:
            raise ValueError(f"{c} was written for target {m['target'].get('name')} "
                             f"({m['target']}), not the loaded one ({teacher.info})")
        mans[c] = m
    folder, vocab = open_cache(root, teacher.info, settings, corpora, special_ids(teacher.model),
                               vocab)
    todo = [(c, s) for c in corpora for s in mans[c]["shards"]
            if not (shard_dir(folder, c, mans[c]) / _file(s)).exists()]
    t0, pos = time.time(), 0
    bar = tqdm(total=len(todo), unit="shard", disable=not (progress and todo), dynamic_ncols=True)
    for c, s in todo:
        if max_minutes is not None and time.time() - t0 > 60 * max_minutes:
            break
        t = columns(c, s, ["prompt_ids", "completion_ids"])
        seqs, starts = rows_of_shard(t["prompt_ids"], t["completion_ids"], settings.max_prompt_tokens)
        out = compute_shard(teacher.model, seqs, starts, settings, vocab.used, teacher.pad_token_id,
                            max_tokens)
        d = shard_dir(folder, c, mans[c])
        d.mkdir(parents=True, exist_ok=True)
        meta = {"corpus_shard": s["file"], "prompt_ids_sha256": _ids_hash(s["prompt_ids"]),
                "vocab_sha256": vocab.sha256()}
        _atomic(d / _file(s), lambda p, o=out, mt=meta: save_file(o, str(p), metadata=mt))
        pos += int(out["offsets"][-1])
        bar.set_postfix(pos_s=f"{pos / (time.time() - t0):.0f}", refresh=False)
        bar.update(1)
    bar.close()
    return folder, vocab


class ShardReader:
    """Lazy reader of one cached shard (safetensors are memory-mapped: rows load on demand)."""

    def __init__(self, path: Path, shard: dict, vocab_sha: str):
        self.path = path
        self.f = safe_open(str(path), framework="pt")
        meta = self.f.metadata() or {}
        if meta.get("prompt_ids_sha256") != _ids_hash(shard["prompt_ids"]) \
                or meta.get("vocab_sha256") != vocab_sha:
            raise ValueError(f"{path}: cached rows do not match corpus shard {shard['file']} or "
                             "the cache's vocabulary; delete the file to recompute it")
        self.offsets = self.f.get_tensor("offsets")
        self.lab_offsets = self.f.get_tensor("lab_offsets")
        self.label_start = self.f.get_tensor("label_start")

    def row(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        la, lb = int(self.lab_offsets[i]), int(self.lab_offsets[i + 1])
        g = lambda name, x, y: self.f.get_slice(name)[x:y]  # noqa: E731
        return {"ids": g("ids", a, b).long(), "feats": g("feats", a, b),
                "label_start": int(self.label_start[i]), "lab_ids": g("lab_ids", la, lb).long(),
                "lab_logp": g("lab_logp", la, lb), "top1": g("top1", la, lb).long()}


def cached(folder: Path, corpus, manifest: dict) -> list[tuple[dict, Path]]:
    """(corpus shard, cache file) for the shards of a corpus cached so far."""
    d = shard_dir(folder, corpus, manifest)
    return [(s, d / _file(s)) for s in manifest["shards"] if (d / _file(s)).exists()]


def main(argv: list[str] | None = None) -> None:
    from dataclasses import replace

    from training.corpus.teacher import CorpusConfig, load_teacher
    from training.corpus.teacher import target_fingerprint

    p = argparse.ArgumentParser(prog="python -m training.head.cache",
                                description=__doc__.split("\n")[0])
    add_option(p, "corpus", several=True, default=["data/corpus", "data/corpus-onpolicy"])
    add_option(p, "root", default=".cache/features")
    add_option(p, "size", default=8192)
    add_option(p, "k", default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, nargs=3, default=None, help="default: 2, L//2, L-3")
    add_option(p, "target")
    add_option(p, "max_tokens", default=4096)
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this many minutes")
    add_option(p, "threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        teacher = load_teacher(CorpusConfig(target=a.target, dtype="float32"))
        # the corpus manifests hash the embedding as loaded in bf16 (configs/corpus.yaml)
        teacher = replace(teacher, info=target_fingerprint(a.target))
        layers = a.layers or default_layers(teacher.model.config.num_hidden_layers)
        settings = CacheSettings(layers, a.size, a.k, a.max_prompt_tokens)
        folder, vocab = build(a.corpus, a.root, settings, teacher, a.max_tokens, a.max_minutes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(folder)


if __name__ == "__main__":
    main()
