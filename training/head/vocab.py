"""The feature head's reduced vocabulary: the target's N most frequent ids over the corpora.

    python -m training.head.vocab --size 8192 [--corpus data/corpus data/corpus-onpolicy]

Counts completion tokens (what the target, or a draft scored by it, actually emits) over the
committed corpora; special ids (BOS/EOS/PAD) are always kept. `used` is sorted ascending, as
the serving engines expect: d2t[i] = used[i] - i (int64 OFFSETS), t2d = bool mask over the
target vocabulary. Ties break by the smaller id, so the choice is deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.options import add_option


@dataclass
class DraftVocab:
    used: torch.Tensor
    """[N] int64 target ids, ascending."""
    target_vocab: int
    """Size of the target vocabulary."""
    coverage: float | None
    """Share of the counted tokens that fall inside the draft vocabulary (None: unknown)."""

    @property
    def d2t(self) -> torch.Tensor:
        return self.used - torch.arange(len(self.used))

    @property
    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.target_vocab, dtype=torch.bool)
        m[self.used] = True
        return m

    def sha256(self) -> str:
        """Identity of the vocabulary (cached labels are only valid for the same one)."""
        return hashlib.sha256(self.used.numpy().tobytes()).hexdigest()[:16]


def count_tokens(corpora: list[str]) -> tuple[Counter, int]:
    """(completion token counts, target vocab size) over the corpora (same target required)."""
    from training.corpus.tokens import any_manifest as read_manifest, columns

    c: Counter = Counter()
    target = None
    for corpus in corpora:
        m = read_manifest(Path(corpus))
        if m is None:
            raise ValueError(f"{corpus}: no manifest.json: not a corpus directory")
        if target is not None and m["target"] != target:
            raise ValueError(f"{corpus} was written for another target than {corpora[0]}")
        target = m["target"]
        for s in m["shards"]:
            for ids in columns(corpus, s, ["completion_ids"])["completion_ids"]:
                c.update(ids)
    return c, int(target["vocab_size"])


def select_vocab(counts: Counter, target_vocab: int, size: int,
                 always: set[int] = frozenset()) -> DraftVocab:
    if not 0 < size <= target_vocab:
        raise ValueError(f"draft vocab size must be in 1..{target_vocab} (got {size})")
    keep = sorted(i for i in always if 0 <= i < target_vocab)[:size]
    ranked = sorted(range(target_vocab), key=lambda i: (-counts.get(i, 0), i))
    chosen = set(keep)
    for i in ranked:
        if len(chosen) >= size:
            break
        chosen.add(i)
    used = torch.tensor(sorted(chosen), dtype=torch.long)
    total = sum(counts.values())
    cover = sum(counts.get(i, 0) for i in chosen) / max(1, total)
    return DraftVocab(used, target_vocab, cover)


def fixed_vocab(used, target_vocab: int, size: int, corpora: list[str] = ()) -> DraftVocab:
    """A given vocabulary (e.g. a head's own when it is re-distilled) instead of a chosen one;
    its coverage is counted over `corpora` (None without them)."""
    used = torch.as_tensor(used, dtype=torch.long).cpu()
    if used.numel() != size:
        raise ValueError(f"the fixed draft vocabulary has {used.numel()} ids, not {size}")
    if used.numel() and (not torch.equal(used, used.unique(sorted=True))
                         or int(used[0]) < 0 or int(used[-1]) >= target_vocab):
        raise ValueError(f"a fixed draft vocabulary must be distinct ascending ids < {target_vocab}")
    cover = None
    if corpora:
        counts, _ = count_tokens(list(corpora))
        cover = sum(counts.get(int(i), 0) for i in used) / max(1, sum(counts.values()))
    return DraftVocab(used, target_vocab, cover)


def build_vocab(corpora: list[str], size: int, always: set[int] = frozenset()) -> DraftVocab:
    counts, vocab = count_tokens(corpora)
    return select_vocab(counts, vocab, size, always)


def special_ids(model) -> set[int]:
    """BOS / EOS / PAD ids of a model's config (kept in every draft vocabulary)."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = {model.config.bos_token_id, model.config.pad_token_id,
           *([eos] if isinstance(eos, int) else eos or [])}
    return {int(i) for i in ids if i is not None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.head.vocab", description=__doc__.split("\n")[0])
    add_option(p, "corpus", several=True, default=["data/corpus", "data/corpus-onpolicy"])
    add_option(p, "size", default=8192)
    a = p.parse_args(argv)
    try:
        v = build_vocab(a.corpus, a.size)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{len(v.used)} ids of {v.target_vocab}, coverage {v.coverage:.4f}, sha {v.sha256()}")


if __name__ == "__main__":
    main()
