"""Trace sets: what the draft proposed and what the target made of it, one row per drafted node.

Recorded by `training.decider.collect` through the engine's observer hook, with features from
`decoding.decider.features` (the same function inference uses). A trace directory holds parquet
shards and a manifest (schema version, feature schema, model pair, collection config);
`--num-shards` runs write `part-i-of-n/` subdirectories that `load_traces` merges.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from decoding.decider.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, node_features, node_hidden
from decoding.sampling import SamplingConfig, warp

from training.shards import read_shards

KIND = "specstop-traces"
SCHEMA_VERSION = 1
SCHEMA = pa.schema([
    ("prompt_id", pa.string()), ("round", pa.int32()), ("position", pa.int32()),
    ("node", pa.int32()), ("parent", pa.int32()), ("depth", pa.int32()), ("branch", pa.int32()),
    ("token", pa.int32()), ("valid", pa.bool_()),
    ("features", pa.list_(pa.float32())),
    ("hidden", pa.binary()),  # draft hidden state in float16 bytes, or null
    ("p_x", pa.float32()), ("q_x", pa.float32()), ("soft_label", pa.float32()),
    ("greedy_match", pa.bool_()), ("accepted", pa.bool_()),
    ("round_depth", pa.int32()), ("round_accepted", pa.int32()),
])
COLUMNS = SCHEMA.names


class TraceRecorder:
    """Engine observer: turns each verified round into rows (labels from the target's logits)."""

    def __init__(self, sampling: SamplingConfig, hidden: bool = False):
        self.sampling = sampling
        self.hidden = hidden
        self.rows: dict[str, list] = {c: [] for c in COLUMNS}
        self.prompt_id = ""
        self.round = 0
        self.drafted = self.accepted = 0

    def start(self, prompt_id: str) -> None:
        self.prompt_id, self.round = prompt_id, 0

    def take(self) -> dict[str, list]:
        rows, self.rows = self.rows, {c: [] for c in COLUMNS}
        return rows

    def __call__(self, tree, logits: torch.Tensor, outcome, position: int) -> None:
        n = tree.size
        anchor_row = len(logits) - n - 1
        on_path = set(outcome.path)
        depth = tree.layout.max_depth
        for level in tree.levels:
            feats = node_features(level)
            hid = node_hidden(level) if self.hidden else None
            # target distribution at each parent, warped like verification warps it
            parents = sorted(set(level.parent_nodes))
            p_rows = {par: warp(logits[anchor_row + 1 + par], self.sampling) for par in parents}
            argmax = {par: int(logits[anchor_row + 1 + par].argmax()) for par in parents}
            for j, node in enumerate(level.nodes):
                par, tok = level.parent_nodes[j], level.tokens[j]
                p_x, q_x = float(p_rows[par][tok]), float(level.q_token[j])
                r = self.rows
                r["prompt_id"].append(self.prompt_id)
                r["round"].append(self.round)
                r["position"].append(position)
                r["node"].append(node)
                r["parent"].append(par)
                r["depth"].append(level.depth)
                r["branch"].append(level.branch[j])
                r["token"].append(tok)
                r["valid"].append(level.valid[j])
                r["features"].append(feats[j].tolist())
                r["hidden"].append(hid[j].to(torch.float16).numpy().tobytes() if hid is not None else None)
                r["p_x"].append(p_x)
                r["q_x"].append(q_x)
                r["soft_label"].append(min(1.0, p_x / q_x) if q_x > 0 else 0.0)
                r["greedy_match"].append(tok == argmax[par])
                r["accepted"].append(node in on_path)
                r["round_depth"].append(depth)
                r["round_accepted"].append(len(outcome.path))
                self.drafted += level.valid[j]
                self.accepted += node in on_path
        self.round += 1


def trace_dirs(root) -> list[Path]:
    """The trace directory itself, or its `part-*` subdirectories (sharded collection)."""
    root = Path(root)
    if (root / "manifest.json").exists():
        return [root]
    parts = sorted(p for p in root.glob("part-*") if (p / "manifest.json").exists())
    if not parts:
        raise ValueError(f"{root}: no trace manifest (not a trace directory)")
    return parts


def load_traces(root) -> tuple[dict, pa.Table]:
    """Manifest and rows of a trace set, merging `part-*` shards; ValueError on bad input."""
    manifest, tables = None, []
    for d in trace_dirs(root):
        m, t = read_shards(d, KIND, SCHEMA_VERSION, SCHEMA)
        if m.get("feature_schema") != FEATURE_SCHEMA_VERSION:
            raise ValueError(f"{d}: feature schema {m.get('feature_schema')}, this code computes "
                             f"{FEATURE_SCHEMA_VERSION}: collect the traces again")
        if manifest is not None and (m["model_pair"] != manifest["model_pair"] or m["collect"] != manifest["collect"]):
            raise ValueError(f"{d}: recorded with another model pair or config than {trace_dirs(root)[0]}")
        manifest = manifest or m
        tables.append(t)
    table = pa.concat_tables(tables)
    return manifest, table


def feature_matrix(table: pa.Table) -> np.ndarray:
    """[rows, NUM_FEATURES] float32."""
    flat = table.column("features").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(table.num_rows, len(FEATURE_NAMES)).astype(np.float32)


def hidden_matrix(table: pa.Table) -> np.ndarray | None:
    col = table.column("hidden").to_pylist()
    if not col or col[0] is None:
        return None
    return np.stack([np.frombuffer(b, dtype=np.float16) for b in col]).astype(np.float32)
