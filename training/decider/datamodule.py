"""Decider training data: a trace set split by PROMPT into train / val / test.

Rows of one prompt are strongly correlated (same text, consecutive rounds), so a row-level
split would leak; every prompt id is hashed once and all its rows follow it. A separate
held-out trace directory can replace the test split (then the main set is split train/val).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from decoding.decider.features import FEATURE_NAMES, NUM_FEATURES

from training.decider.traces import feature_matrix, hidden_matrix, load_traces

LABELS = ("soft", "hard", "accepted")
EVAL_TARGETS = ("auto", "greedy_match", "accepted")
BALANCE = ("none", "pos_weight", "sampler")
SPLITS = ("train", "val", "test")


@dataclass
class Split:
    """All rows of one split's prompts (replay needs invalid nodes too) plus arrays."""

    table: pa.Table
    features: np.ndarray
    hidden: np.ndarray | None
    label: np.ndarray
    """Training label in [0, 1]: soft_label, greedy_match or accepted."""
    target: np.ndarray
    """Hard 0/1 evaluation target; -1 where it is undefined (never trained on or scored)."""
    valid: np.ndarray
    prompts: list[str]
    trainable: np.ndarray
    """Rows whose label is defined: valid nodes (label accepted: only those whose parent was
    accepted; elsewhere the node was never tried)."""

    @property
    def rows(self) -> np.ndarray:
        """Rows a decider is trained on: nodes the draft really proposed (and, for label
        accepted, that verification reached)."""
        return np.flatnonzero(self.trainable)


def prompt_split(prompt_id: str, seed: int, val: float, test: float) -> str:
    """Deterministic split of one prompt: a hash, never a row order or an RNG state."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8], "big") / 2.0**64
    return "test" if u < test else "val" if u < test + val else "train"


def reached(table: pa.Table) -> np.ndarray:
    """Rows whose parent was accepted (or is the anchor): there acceptance was decided."""
    cols = {c: table.column(c).to_numpy(zero_copy_only=False)
            for c in ("prompt_id", "round", "node", "parent", "accepted")}
    acc = {(p, r, n) for p, r, n, a in zip(cols["prompt_id"], cols["round"], cols["node"],
                                           cols["accepted"]) if a}
    return np.array([par < 0 or (p, r, par) in acc
                     for p, r, par in zip(cols["prompt_id"], cols["round"], cols["parent"])], dtype=bool)


class RowDataset(Dataset):
    def __init__(self, split: Split, rows: np.ndarray, with_hidden: bool):
        self.x = torch.from_numpy(split.features[rows])
        self.h = torch.from_numpy(split.hidden[rows]) if with_hidden else None
        self.y = torch.from_numpy(split.label[rows])
        self.t = torch.from_numpy(split.target[rows])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        item = {"features": self.x[i], "label": self.y[i], "target": self.t[i]}
        if self.h is not None:
            item["hidden"] = self.h[i]
        return item


class TraceDataModule(L.LightningDataModule):
    """Loads a trace set (`training.decider.collect` output) and splits it by prompt."""

    def __init__(self, traces: str = "runs/traces", test_traces: str | None = None,
                 label: str = "soft", eval_target: str = "auto", val_fraction: float = 0.15,
                 test_fraction: float = 0.15, split_seed: int = 0, batch_size: int = 256,
                 balance: str = "none", with_hidden: bool = False, num_workers: int = 0):
        """
        Args:
            traces: trace directory (manifest.json + shards, or part-*/ subdirectories).
            test_traces: optional held-out trace directory used as the test split.
            label: soft = min(1, p/q) (the released hidden-state decider); hard = greedy_match;
                accepted = the node was on the accepted path, trained on nodes whose parent
                was: P(node accepted | parent accepted), what a tree's node values need under
                sampling (min(1, p/q) overstates it for later siblings, which MCSD verifies
                against the residual; at temperature 0 it equals hard on those rows).
            eval_target: hard 0/1 target for ROC/PR/Brier/ECE. auto = greedy_match for greedy
                traces (temperature 0: exactly 'accepted given the parent was'), else accepted
                on rows whose parent was accepted.
            val_fraction: share of prompts for validation (early stopping + threshold replay).
            test_fraction: share of prompts for the test split (ignored with test_traces).
            split_seed: salt of the prompt hash.
            batch_size: 50..512.
            balance: none; pos_weight (BCE pos_weight = neg/pos); sampler (class-balanced
                sampling). Both are undone at export by a logit shift so scores stay calibrated.
            with_hidden: also load the draft hidden states (linked to the hidden-state kinds).
            num_workers: DataLoader workers.
        """
        super().__init__()
        if label not in LABELS:
            raise ValueError(f"data.label must be one of {LABELS} (got {label!r})")
        if eval_target not in EVAL_TARGETS:
            raise ValueError(f"data.eval_target must be one of {EVAL_TARGETS} (got {eval_target!r})")
        if balance not in BALANCE:
            raise ValueError(f"data.balance must be one of {BALANCE} (got {balance!r})")
        if not 50 <= batch_size <= 512:
            raise ValueError(f"data.batch_size must be in 50..512 (got {batch_size})")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError("data.val_fraction must be in (0, 1), test_fraction in [0, 1), sum < 1")
        self.traces, self.test_traces = traces, test_traces
        self.label, self.eval_target_name = label, eval_target
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.batch_size, self.balance, self.with_hidden = batch_size, balance, with_hidden
        self.num_workers = num_workers
        self.splits: dict[str, Split] = {}
        self.manifest: dict = {}

    # --- loading --------------------------------------------------------------------------
    def _load(self, path: str) -> tuple[dict, pa.Table]:
        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"trace directory not found: {p}")
        manifest, table = load_traces(p)
        names = manifest.get("feature_names")
        if names is not None and list(names) != list(FEATURE_NAMES):
            raise ValueError(f"{p}: recorded features {names} differ from this code's {FEATURE_NAMES}")
        if table.num_rows == 0:
            raise ValueError(f"{p}: the trace set has no rows")
        if len(table.column("features")[0]) != NUM_FEATURES:
            raise ValueError(f"{p}: rows have {len(table.column('features')[0])} features, "
                             f"this code computes {NUM_FEATURES}")
        if self.with_hidden and table.column("hidden")[0].as_py() is None:
            raise ValueError(f"{p}: no draft hidden states: collect with hidden: true for kind hidden")
        return manifest, table

    def _split(self, table: pa.Table, rows: np.ndarray, target_name: str) -> Split:
        t = table.take(pa.array(rows, pa.int64()))
        feats = feature_matrix(t)
        accepted = t.column("accepted").to_numpy(zero_copy_only=False).astype(np.float32)
        greedy = t.column("greedy_match").to_numpy(zero_copy_only=False).astype(np.float32)
        label = {"hard": greedy, "accepted": accepted}.get(self.label)
        if label is None:  # soft
            label = t.column("soft_label").to_numpy().astype(np.float32)
        valid = t.column("valid").to_numpy(zero_copy_only=False).astype(bool)
        # which nodes verification reached: only where a label or the target needs it (a pass
        # over every row)
        reach = reached(t) if self.label == "accepted" or target_name != "greedy_match" else None
        if target_name == "greedy_match":
            target = greedy
        else:
            target = np.where(reach, accepted, -1).astype(np.float32)
        hidden = hidden_matrix(t) if self.with_hidden else None
        prompts = sorted(set(t.column("prompt_id").to_pylist()))
        trainable = valid & reach if self.label == "accepted" else valid
        return Split(t, feats, hidden, label, target, valid, prompts, trainable)

    def load(self) -> dict[str, Split]:
        """Load and split once (idempotent); ValueError with a one-line message on bad input."""
        if self.splits:
            return self.splits
        manifest, table = self._load(self.traces)
        temp = float(manifest.get("collect", {}).get("temperature", 0.0) or 0.0)
        if self.label == "hard" and temp > 0:
            warnings.warn(f"data.label hard trains on greedy_match, but {self.traces} was sampled "
                          f"(temperature {temp}): label accepted (or soft) matches the sampling acceptance rule", stacklevel=2)
        name = self.eval_target_name
        if name == "auto":
            name = "greedy_match" if temp == 0 else "accepted"
        test_frac = 0.0 if self.test_traces else self.test_fraction
        pids = table.column("prompt_id").to_pylist()
        which = {p: prompt_split(p, self.split_seed, self.val_fraction, test_frac) for p in set(pids)}
        assign = np.array([which[p] for p in pids])
        splits = {s: self._split(table, np.flatnonzero(assign == s), name) for s in SPLITS
                  if s != "test" or not self.test_traces}
        if self.test_traces:
            tm, tt = self._load(self.test_traces)
            if tm.get("model_pair") != manifest.get("model_pair"):
                raise ValueError(f"{self.test_traces}: recorded with another model pair than {self.traces}")
            shared = set(tt.column("prompt_id").to_pylist()) & set(which)
            if shared:
                raise ValueError(f"{self.test_traces}: {len(shared)} prompt(s) also in {self.traces} "
                                 f"(e.g. {min(shared)}): the test set must be held out")
            splits["test"] = self._split(tt, np.arange(tt.num_rows), name)
        for s, sp in splits.items():
            if not len(sp.rows):
                raise ValueError(f"the {s} split is empty ({len(which)} prompts in {self.traces}): "
                                 f"collect more prompts or change data.{s}_fraction")
        self.manifest, self.eval_target, self.splits = manifest, name, splits
        return splits

    def whole(self, path: str) -> tuple[dict, Split]:
        """Every row of another trace set as one split (e.g. held-out traces for retraining)."""
        manifest, table = self._load(path)
        temp = float(manifest.get("collect", {}).get("temperature", 0.0) or 0.0)
        name = self.eval_target_name
        name = ("greedy_match" if temp == 0 else "accepted") if name == "auto" else name
        return manifest, self._split(table, np.arange(table.num_rows), name)

    def setup(self, stage: str | None = None) -> None:
        self.load()

    # --- what the model needs from the data ----------------------------------------------
    @property
    def hidden_size(self) -> int:
        h = self.load()["train"].hidden
        return 0 if h is None else int(h.shape[1])

    def train_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training rows' features and hidden states (to fit the input standardisation)."""
        tr = self.load()["train"]
        rows = tr.rows
        return (torch.from_numpy(tr.features[rows]),
                torch.from_numpy(tr.hidden[rows]) if tr.hidden is not None else None)

    def prior_ratio(self) -> float:
        """Odds factor class balancing multiplies the positives by: neg/pos mass of the
        training label for pos_weight, neg/pos counts of its hard side for the sampler."""
        tr = self.load()["train"]
        y = tr.label[tr.rows]
        if self.balance == "sampler":
            y = (y > 0.5).astype(np.float32)
        pos = float(y.sum())
        return float((len(y) - pos) / pos) if 0 < pos < len(y) else 1.0

    # --- loaders ---------------------------------------------------------------------------
    def dataset(self, split: str) -> RowDataset:
        sp = self.load()[split]
        return RowDataset(sp, sp.rows, self.with_hidden)

    def train_dataloader(self) -> DataLoader:
        ds = self.dataset("train")
        if self.balance == "sampler":
            pos = ds.y > 0.5  # soft labels: balance by their hard side
            w = torch.where(pos, 1.0 / max(int(pos.sum()), 1), 1.0 / max(int((~pos).sum()), 1))
            gen = torch.Generator().manual_seed(self.split_seed)
            sampler = WeightedRandomSampler(w.double(), len(ds), replacement=True, generator=gen)
            return DataLoader(ds, self.batch_size, sampler=sampler, num_workers=self.num_workers)
        return DataLoader(ds, self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("val"), 512, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("test"), 512, num_workers=self.num_workers)
