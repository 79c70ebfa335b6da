"""LightningDataModule over the teacher corpus for draft distillation.

A batch holds right-padded sequences (prompt + completion) and, for every completion token,
its flat position, the token itself, its kind (code/general) and -- with the cached teacher
-- the target's top-k ids and log-probs there. Validation is a fixed slice of the corpus,
chosen by a hash of the prompt id (stable as the corpus grows; never trained on).
Extra corpora (e.g. on-policy rows written by a draft) add training rows only: validation
stays the target-written text the draft will be judged on.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from training.corpus.teacher import base_id
from training.draft.teacher_cache import TeacherRows, build_cache, cached_shards, load_cache


@dataclass
class Row:
    prompt: list[int]
    completion: list[int]
    code: bool
    t_ids: torch.Tensor | None = None
    t_logp: torch.Tensor | None = None
    target_written: bool = True
    """False for rows a draft wrote (on-policy): their tokens say nothing of the target's."""


class RowDataset(Dataset):
    def __init__(self, rows: list[Row]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:
        return self.rows[i]


def hash_bucket(prompt_id: str) -> int:
    """A stable bucket in [0, 10000) of the PROMPT (every sample of a prompt, every turn of a
    conversation lands in one)."""
    return int.from_bytes(hashlib.sha256(base_id(prompt_id).encode()).digest()[:4], "big") % 10000


def is_val(prompt_id: str, percent: float) -> bool:
    """Validation rows by a hash of the prompt (training.corpus.chat_data splits by it too); a
    further answer to a prompt ("<id>~k", training.corpus.scale `samples`) goes where its prompt
    goes, so no prompt trains in one answer and validates in another."""
    return hash_bucket(prompt_id.split("~", 1)[0]) < percent * 100


def collate(rows: list[Row], pad_id: int = 0, max_prompt_tokens: int = 256) -> dict:
    """Right-pad rows; prompts keep their last max_prompt_tokens tokens (the draft is short-sighted)."""
    seqs, starts = [], []
    for r in rows:
        p = r.prompt[-max_prompt_tokens:] if max_prompt_tokens else r.prompt
        seqs.append(p + r.completion)
        starts.append(len(p))
    width = max(map(len, seqs))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pos, code = [], []
    for i, (s, p0, r) in enumerate(zip(seqs, starts, rows)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        # the logits at flat index i*width + t predict token t + 1
        pos.append(torch.arange(p0 - 1, len(s) - 1) + i * width)
        code.append(torch.full((len(s) - p0,), r.code))
    out = {"input_ids": ids, "attention_mask": mask, "positions": torch.cat(pos),
           "targets": torch.cat([torch.tensor(r.completion) for r in rows]),
           "code": torch.cat(code), "prompt_lens": torch.tensor(starts)}
    if rows[0].t_ids is not None:
        out["t_ids"] = torch.cat([r.t_ids for r in rows]).long()
        out["t_logp"] = torch.cat([r.t_logp for r in rows])
    return out


class CorpusDataModule(L.LightningDataModule):
    def __init__(self, corpus: str = "data/corpus", teacher_cache: str = ".cache/teacher",
                 teacher: str = "cached", k: int = 64, batch_size: int = 16,
                 val_percent: float = 3.0, max_val_rows: int = 256,
                 max_prompt_tokens: int = 256, max_rows: int | None = None,
                 cache_max_tokens: int = 4096, refresh: bool = True, build_cache: bool = True,
                 hard_labels_uncached: bool = False, extra_corpora: list[str] | None = None,
                 extra_writers: list[str] | None = None):
        """Args:
            corpus: corpus directory (training.corpus.teacher).
            teacher_cache: root folder of cached teacher top-k (git-ignored).
            teacher: cached (top-k read from the cache, built here if missing) | online
                (no cache; the module runs the target on every batch).
            k: teacher top-k buckets (plus one "rest" bucket).
            batch_size: rows per batch (per process under ddp).
            val_percent: share of corpus prompts held out for validation (by id hash).
            max_val_rows: cap on validation rows (validation runs often).
            max_prompt_tokens: prompt context kept before each completion.
            max_rows: train on at most the first N training rows of the corpus (data-scaling
                runs, smoke tests); validation rows are read regardless, so every run is
                validated on the same rows.
            cache_max_tokens: padded tokens per teacher prefill batch when building the cache.
            refresh: at every epoch start, add corpus shards cached since (needs
                trainer.reload_dataloaders_every_n_epochs: 1).
            build_cache: fill the teacher cache for uncached shards before training
                (false: use the shards cached so far, e.g. while a cache job runs beside).
            hard_labels_uncached: also train on shards not cached yet, with their sampled
                token as a one-hot teacher (fkl = cross-entropy) until their cache appears.
            extra_corpora: more corpus directories for the same target, trained on but never
                validated on (rows of validation-hash prompts are skipped): e.g. on-policy
                corpora written by a draft (training.corpus.teacher --writer).
            extra_writers: train only on the extra corpora's shards written by these drafts
                (the writer name each shard records; null: every shard): a recipe stage
                keeps its data while later drafts add to the same on-policy corpus.
        """
        super().__init__()
        if teacher not in ("cached", "online"):
            raise ValueError(f"teacher must be cached or online (got {teacher!r})")
        self.corpus, self.cache_root, self.teacher, self.k = corpus, teacher_cache, teacher, k
        self.batch_size, self.val_percent, self.max_val_rows = batch_size, val_percent, max_val_rows
        self.max_prompt_tokens, self.max_rows = max_prompt_tokens, max_rows
        self.cache_max_tokens, self.refresh, self.build = cache_max_tokens, refresh, build_cache
        self.hard_labels_uncached = hard_labels_uncached
        self.extra_corpora = list(extra_corpora or [])
        self.extra_writers = None if extra_writers is None else set(extra_writers)
        self.by_shard: dict[str, list[Row]] = {}  # train rows per "<corpus dir>/<shard file>"
        self.soft: set[str] = set()  # shards (same keys) loaded with teacher logits
        self.n_seen = 0  # rows read so far (max_rows)
        self.pad_id = 0
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []

    def prepare_data(self) -> None:
        # rank 0 only under ddp: fill the cache for corpus shards that arrived since last time
        if self.teacher == "cached" and self.build:
            for corpus in self.corpora():
                build_cache(corpus, self.cache_root, self.k, max_tokens=self.cache_max_tokens)

    def corpora(self) -> list[str]:
        """The validated corpus first, then the training-only extras."""
        return [self.corpus, *self.extra_corpora]

    def setup(self, stage: str | None = None) -> None:
        if not self.train_rows:
            self._refresh()
            if not self.train_rows or not self.val_rows:
                raise ValueError(f"{self.corpus}: the corpus leaves an empty train or validation "
                                 "split; change data.val_percent or grow the corpus")

    def _refresh(self) -> None:
        """Load corpus shards not loaded yet (and upgrade hard-label shards now cached).

        The validation rows are fixed at the first call, from shards with teacher logits of
        the first corpus (a stable learning curve); later validation-hash rows are neither
        trained nor scored.
        """
        for n, corpus in enumerate(self.corpora()):
            self._refresh_corpus(corpus, validate=n == 0)
        self.train_rows = [r for rows in self.by_shard.values() for r in rows]

    def _refresh_corpus(self, corpus: str, validate: bool) -> None:
        from training.corpus.teacher import read_manifest

        m = read_manifest(Path(corpus))
        if m is None:
            raise ValueError(f"{corpus}: no manifest.json: not a corpus directory")
        if not validate and m["target"] != read_manifest(Path(self.corpus))["target"]:
            raise ValueError(f"{corpus} was written for another target than {self.corpus}")
        listed = [s["file"] for s in m["shards"] if validate or self._wanted(s)]
        soft = listed
        if self.teacher == "cached":  # the corpus (and its cache) may be growing right now
            soft = [n for n in cached_shards(corpus, self.cache_root, self.k) if n in listed]
        hard = [n for n in listed if n not in soft] if self.hard_labels_uncached else []
        if self.trainer is not None:  # under ddp every rank must train on the same rows
            soft, hard = self.trainer.strategy.broadcast((soft, hard), src=0)
        key = lambda name: f"{corpus}/{name}"
        new_soft = [n for n in soft if key(n) not in self.soft]
        new_hard = [n for n in hard if key(n) not in self.by_shard]
        first = validate and not any(k.startswith(f"{corpus}/") for k in self.by_shard)
        vocab, on_policy = m["target"].get("vocab_size"), bool(m["generation"].get("on_policy"))
        if new_soft:
            shards, teach = [s for s in m["shards"] if s["file"] in new_soft], None
            if self.teacher == "cached":
                shards, teach = load_cache(corpus, self.cache_root, self.k, only=new_soft)
            self._add(corpus, shards, teach, first, vocab, on_policy)
            self.soft.update(map(key, new_soft))
        if new_hard:
            self._add(corpus, [s for s in m["shards"] if s["file"] in new_hard], None, False,
                      vocab, on_policy, hard=True)

    def _wanted(self, shard: dict) -> bool:
        writer = (shard.get("writer") or {}).get("name")
        return self.extra_writers is None or writer in self.extra_writers

    def _add(self, corpus: str, shards: list[dict], teach: TeacherRows | None, first: bool,
             vocab, on_policy: bool, hard: bool = False) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = pa.concat_tables([pq.read_table(Path(corpus) / s["file"]) for s in shards])
        cols, at = cols.to_pydict(), 0
        for s in shards:
            train: list[Row] = []
            for i in range(at, at + s["rows"]):
                val = is_val(cols["prompt_id"][i], self.val_percent)
                if not val:  # the budget counts training rows: validation stays the same set
                    if self.max_rows is not None and self.n_seen >= self.max_rows:
                        continue
                    self.n_seen += 1
                elif not (first and not hard and len(self.val_rows) < self.max_val_rows):
                    continue
                r = Row(cols["prompt_ids"][i], cols["completion_ids"][i], cols["kind"][i] == "code",
                        target_written=not on_policy)
                if teach is not None:
                    r.t_ids, r.t_logp = teach.row(i)
                elif hard:  # one-hot teacher on the sampled token: fkl reduces to CE
                    tok = torch.tensor(r.completion, dtype=torch.int32)[:, None]
                    r.t_ids = (tok + torch.arange(self.k, dtype=torch.int32)) % int(vocab)
                    r.t_logp = torch.full(r.t_ids.shape, float("-inf"), dtype=torch.float16)
                    r.t_logp[:, 0] = 0.0
                (self.val_rows if val else train).append(r)
            at += s["rows"]
            self.by_shard[f"{corpus}/{s['file']}"] = train

    def train_tokens(self) -> int:
        return sum(len(r.completion) for r in self.train_rows)

    def token_counts(self) -> Counter:
        """How often each id is the teacher's top-1 or the corpus token (train rows)."""
        c: Counter = Counter()
        for r in self.train_rows:
            if r.target_written:
                c.update(r.completion)
            if r.t_ids is not None:
                c.update(r.t_ids[:, 0].tolist())
        return c

    def _loader(self, rows: list[Row], shuffle: bool) -> DataLoader:
        mp, pad = self.max_prompt_tokens, self.pad_id
        return DataLoader(RowDataset(rows), batch_size=self.batch_size, shuffle=shuffle,
                          collate_fn=lambda b: collate(b, pad, mp), num_workers=0)

    def train_dataloader(self) -> DataLoader:
        if self.refresh and self.trainer is not None and self.trainer.current_epoch > 0:
            # a growing corpus: load the shards cached meanwhile (by `python -m
            # training.draft.teacher_cache` running beside; caching here would stall training)
            self._refresh()
        return self._loader(self.train_rows, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, False)
