"""LightningDataModule for the feature head: corpus rows with the target's states and labels.

source = cached: rows come from the feature cache (training.head.cache; built here
for the shards not cached yet when build_cache is on). source = online: rows carry token ids
only and the module runs the target's prefill inside the training step. Batches hold at most
`max_tokens` padded positions (rows of similar length together, batches shuffled, new
batches every epoch). Validation is a fixed slice of the first corpus, chosen by a hash of the
prompt id (stable as the corpus grows, never trained on); extra corpora train only.
The rows are fixed at setup: shards cached later (a cache job beside) join at the next run,
which resumes from last.ckpt.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from training.draft.data import is_val
from training.head.cache import CacheSettings, ShardReader, build, cached, default_layers, open_cache
from training.head.vocab import DraftVocab


def collate(rows: list[dict], pad_id: int = 0) -> dict:
    """Right-padded batch. With cached rows also feats [B, W, 3H] float32 and dense labels:
    lab_ids / lab_logp [B, W, k], top1 [B, W], lab_mask [B, W] (position t predicts a
    completion token)."""
    width = max(len(r["ids"]) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["ids"])] = r["ids"]
        mask[i, : len(r["ids"])] = 1
    out = {"input_ids": ids, "attention_mask": mask, "code": torch.tensor([r["code"] for r in rows]),
           "label_start": torch.tensor([r["label_start"] for r in rows])}
    if "feats" not in rows[0]:
        return out
    k = rows[0]["lab_ids"].shape[-1]
    feats = torch.zeros(b, width, rows[0]["feats"].shape[-1])
    lab_ids = torch.zeros(b, width, k, dtype=torch.long)
    lab_logp = torch.full((b, width, k), float("-inf"))
    top1 = torch.zeros(b, width, dtype=torch.long)
    lab_mask = torch.zeros(b, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        feats[i, : len(r["ids"])] = r["feats"].float()
        a, n = r["label_start"], len(r["top1"])
        lab_ids[i, a: a + n], lab_logp[i, a: a + n] = r["lab_ids"], r["lab_logp"].float()
        top1[i, a: a + n], lab_mask[i, a: a + n] = r["top1"], True
    return out | {"feats": feats, "lab_ids": lab_ids, "lab_logp": lab_logp, "top1": top1,
                  "lab_mask": lab_mask}


def token_batches(lengths: list[int], max_tokens: int, seed: int | None) -> list[list[int]]:
    """Row indices in batches of <= max_tokens padded positions; seed None = in order."""
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if seed is not None:
        rng.shuffle(order)
    out = []
    for g in range(0, len(order), 256):  # sort within windows: little padding, still random
        win = sorted(order[g: g + 256], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in win:
            if cur and (len(cur) + 1) * lengths[i] > max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        out += [cur] if cur else []
    if seed is not None:
        rng.shuffle(out)
    return out


class _Batches(Dataset):
    def __init__(self, rows: list, batches: list[list[int]], load, pad_id: int):
        self.rows, self.batches, self.load, self.pad_id = rows, batches, load, pad_id
        self.offset = 0  # batches already consumed this epoch (a resumed run starts past them)

    def __len__(self) -> int:
        return len(self.batches) - self.offset

    def __getitem__(self, i: int) -> dict:
        return collate([self.load(self.rows[j]) for j in self.batches[self.offset + i]], self.pad_id)


def batches_digest(batches: list[list[int]]) -> str:
    """Identity of one epoch's batch order (the rows, their grouping and the shuffle)."""
    return hashlib.sha256(json.dumps(batches, separators=(",", ":")).encode()).hexdigest()


class ResumableLoader(DataLoader):
    """One epoch's fixed batch order whose position Lightning saves in its checkpoint (state_dict)
    and restores (load_state_dict): a resumed run continues with the epoch's next unseen batch,
    not its first. __len__ stays the whole epoch's, as Lightning counts the consumed batches in."""

    def __init__(self, dataset: _Batches, epoch: int, **kw):
        self.epoch, self.digest = epoch, batches_digest(dataset.batches)
        self.total, self.consumed = len(dataset.batches), 0
        super().__init__(dataset, batch_size=None, shuffle=False, **kw)

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        self.consumed = self.dataset.offset
        for batch in super().__iter__():
            self.consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "batches": self.total, "digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        if state.get("epoch") != self.epoch:
            return
        skip = min(int(state.get("consumed", 0)), self.total)
        if state.get("digest") != self.digest:  # the corpora changed: the rest of this epoch is reshuffled
            print(f"note: the training rows changed since the checkpoint (epoch {self.epoch}): the epoch "
                  f"continues after {skip} batches of a new order", file=sys.stderr)
        self.dataset.offset = skip


def restore_position(trainer) -> None:
    """Hand a resumed run's saved loader position to its loader. Lightning applies it in
    FitLoop.setup_data, which returns early when configure_optimizers already built the loader
    (trainer.estimated_stepping_batches), leaving it unapplied; the loader's iteration has not
    begun by on_train_start, so applying it there is in time."""
    loop = trainer.fit_loop
    states = getattr(loop, "_combined_loader_states_to_load", None)
    if states and loop._combined_loader is not None:
        loop._combined_loader._load_state_dicts(states)
        loop._combined_loader_states_to_load = []


class FeatureDataModule(L.LightningDataModule):
    def __init__(self, corpora: list[str] | None = None, target: str | None = None,
                 source: str = "cached", cache_root: str = ".cache/features",
                 draft_vocab_size: int = 8192, k: int = 32, layers: list[int] | None = None,
                 max_prompt_tokens: int = 256, max_tokens: int = 4096, val_percent: float = 5.0,
                 max_val_rows: int = 128, max_rows: int | None = None, build_cache: bool = True,
                 cache_max_tokens: int = 4096, seed: int = 0, vocab_from: str | None = None,
                 num_workers: int = 0, train_from: dict[str, int] | None = None):
        """Args:
            corpora: corpus directories of one target; the first gives the validation slice.
            target: target model dir (None = embedded SmolLM2); the corpora must be its own.
            source: cached (read the feature cache) | online (the module runs the target).
            cache_root: root of the feature cache (git-ignored, rebuilt on a fresh machine).
            draft_vocab_size: the head's vocabulary (the target's most frequent ids).
            k: top-k draft-vocabulary log-probs per labelled position (soft labels).
            layers: the three target layers captured (null: 2, L//2, L-3).
            max_prompt_tokens: prompt context kept before each completion (with a chat corpus,
                the earlier turns: 1024 or more trains longer windows).
            max_tokens: padded positions per training batch.
            val_percent, max_val_rows: held-out slice of the first corpus (by prompt hash).
            max_rows: train on at most the first N training rows (smoke tests, scaling).
            build_cache: cache the shards not cached yet before training (false: train on
                what is cached so far, e.g. while a cache job runs beside).
            cache_max_tokens: padded positions per prefill batch when building the cache.
            seed: batch shuffling seed (epoch e uses seed + e).
            vocab_from: an exported feature head whose draft vocabulary the cache and labels
                use instead of one chosen from the corpora (re-distilling that head, e.g.
                warm-started from it); its size replaces draft_vocab_size.
            num_workers: dataloader worker processes (0: batches are read in the training
                process; a GPU run on the cache may want 2-4, the online source needs none).
            train_from: corpus -> index of its first shard trained on (a corpus not named
                trains whole): a warm-started head continued on the text it has not read yet.
                An index at or past a corpus's shard count trains nothing from it; the first
                corpus still gives the validation slice.
        """
        super().__init__()
        if source not in ("cached", "online"):
            raise ValueError(f"source must be cached or online (got {source!r})")
        self.corpora = list(corpora or ["data/corpus", "data/corpus-onpolicy"])
        self.target, self.source, self.root = target, source, cache_root
        self.vocab_size, self.k, self.layers = draft_vocab_size, k, layers
        self.max_prompt_tokens, self.max_tokens = max_prompt_tokens, max_tokens
        self.val_percent, self.max_val_rows, self.max_rows = val_percent, max_val_rows, max_rows
        self.build_cache, self.cache_max_tokens, self.seed = build_cache, cache_max_tokens, seed
        self.vocab_from, self.num_workers = vocab_from, num_workers
        self.train_from = dict(train_from or {})
        unknown = set(self.train_from) - set(self.corpora)
        if unknown:
            raise ValueError(f"data.train_from names {sorted(unknown)}, not among data.corpora")
        self._fixed = None
        self.vocab: DraftVocab | None = None
        self.target_info: dict | None = None
        self.train_rows: list = []
        self.val_rows: list = []
        self._readers: dict[str, ShardReader] = {}

    # --- identity -----------------------------------------------------------------------
    def fixed_vocab(self):
        """The vocab_from head's target ids (None: the cache chooses them from the corpora)."""
        if self.vocab_from is not None and self._fixed is None:
            from decoding.drafts.io import head_vocab

            self._fixed = head_vocab(self.vocab_from)
        return self._fixed

    def settings(self) -> CacheSettings:
        from transformers import AutoConfig

        from decoding.models import resolve_model_dir

        layers = self.layers or default_layers(
            AutoConfig.from_pretrained(resolve_model_dir(self.target)).num_hidden_layers)
        fixed = self.fixed_vocab()
        size = self.vocab_size if fixed is None else len(fixed)
        return CacheSettings(list(layers), size, self.k, self.max_prompt_tokens)

    def _manifests(self) -> dict[str, dict]:
        from training.corpus.teacher import target_fingerprint
        from training.corpus.tokens import any_manifest as read_manifest  # either corpus format

        self.target_info = self.target_info or target_fingerprint(self.target)
        out = {}
        for c in self.corpora:
            m = read_manifest(Path(c))
            if m is None:
                raise ValueError(f"{c}: no manifest.json: not a corpus directory")
            if m["target"] != self.target_info:
                raise ValueError(f"{c} was written for target {m['target'].get('name')}, not for "
                                 f"{self.target or 'the embedded target'} ({self.target_info})")
            out[c] = m
        return out

    # --- rows -----------------------------------------------------------------------------
    def prepare_data(self) -> None:
        if self.source == "cached" and self.build_cache:
            from dataclasses import replace

            from training.corpus.teacher import CorpusConfig, load_teacher

            self._manifests()
            teacher = load_teacher(CorpusConfig(target=self.target, dtype="float32"))
            build(self.corpora, self.root, self.settings(), replace(teacher, info=self.target_info),
                  self.cache_max_tokens, vocab=self.fixed_vocab())

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        from decoding.models import load_model
        from training.corpus.tokens import columns

        mans = self._manifests()
        settings = self.settings()
        self.layers = settings.layers
        if self.source == "cached":
            folder, self.vocab = open_cache(self.root, self.target_info, settings, self.corpora,
                                            vocab=self.fixed_vocab())
        elif self.fixed_vocab() is not None:
            from training.head.vocab import fixed_vocab

            folder = None
            self.vocab = fixed_vocab(self.fixed_vocab(), int(self.target_info["vocab_size"]),
                                     settings.draft_vocab_size, self.corpora)
        else:
            from training.head.vocab import build_vocab, special_ids

            folder = None
            always = special_ids(load_model(self.target))
            self.vocab = build_vocab(self.corpora, settings.draft_vocab_size, always)
        seen = 0
        for n, c in enumerate(self.corpora):
            shards = (cached(folder, c, mans[c]) if folder else
                      [(s, None) for s in mans[c]["shards"]])
            order = {e["file"]: j for j, e in enumerate(mans[c]["shards"])}
            for s, path in shards:
                cols = columns(c, s)
                read = order[s["file"]] >= self.train_from.get(c, 0)
                for i in range(s["rows"]):
                    val = is_val(cols["prompt_id"][i], self.val_percent)
                    if val and (n > 0 or len(self.val_rows) >= self.max_val_rows):
                        continue  # other corpora never validate, nor train on held-out prompts
                    if not val and not read:
                        continue  # text the warm start has read (train_from)
                    if not val:
                        if self.max_rows is not None and seen >= self.max_rows:
                            continue
                        seen += 1
                    p = cols["prompt_ids"][i][-self.max_prompt_tokens:]
                    row = {"code": cols["kind"][i] == "code", "n": len(p) + len(cols["completion_ids"][i])}
                    if path is None:
                        row |= {"ids": p + cols["completion_ids"][i], "label_start": len(p) - 1}
                    else:
                        row |= {"path": str(path), "shard": s, "i": i}
                    (self.val_rows if val else self.train_rows).append(row)
        if not self.train_rows or not self.val_rows:
            raise ValueError(f"{self.corpora}: nothing cached, or the corpus leaves an empty train "
                             "or validation split (build the cache, or change data.val_percent)")

    def _load(self, row: dict) -> dict:
        if "path" not in row:
            return {"ids": torch.tensor(row["ids"]), "label_start": row["label_start"],
                    "code": row["code"]}
        r = self._readers.get(row["path"])
        if r is None:
            r = self._readers[row["path"]] = ShardReader(Path(row["path"]), row["shard"],
                                                         self.vocab.sha256())
        return r.row(row["i"]) | {"code": row["code"]}

    @property
    def window(self) -> int:
        """The longest training sequence in tokens (prompt context + completion): the window
        the head is trained on, recorded as trained_window in its checkpoint and export."""
        return max((r["n"] for r in self.train_rows), default=0)

    def positions(self, rows: list | None = None) -> int:
        return sum(r["n"] for r in (self.train_rows if rows is None else rows))

    def _loader(self, rows: list, seed: int | None, epoch: int | None = None) -> DataLoader:
        batches = _Batches(rows, token_batches([r["n"] for r in rows], self.max_tokens, seed), self._load, 0)
        # workers (num_workers > 0) read cached rows beside the step; pinned memory for a GPU's copies
        cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        kw = {"num_workers": self.num_workers, "pin_memory": cuda}
        return DataLoader(batches, batch_size=None, shuffle=False, **kw) if epoch is None else \
            ResumableLoader(batches, epoch, **kw)

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return self._loader(self.train_rows, self.seed + epoch, epoch)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, None)
