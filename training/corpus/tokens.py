"""A token corpus: target-written text as compact token files (written by training.corpus.scale).

Layout of a corpus directory (committed: ~2 bytes a position plus a small JSON row header):
    manifest.json            kind specstop-token-corpus, schema version, the target's identity,
                             the generation settings, token_dtype, and one entry per finished
                             shard (file, rows, turns, prompts, tokens, target_tokens, bytes, engine)
    shard-00000.safetensors  tensors (no pickle, memory-mappable):
        tokens   [N] uint16 (uint32 when the target's vocabulary has 65,536 ids or more):
                 every row's ids end to end
        offsets  [rows + 1] int64: row i is tokens[offsets[i]:offsets[i + 1]]
        spans    [S, 2] int64: [start, end) of each target-written turn, absolute in tokens
                 (the loss mask: the head trains on these positions only)
        span_offsets [rows + 1] int64: row i's turns are spans[span_offsets[i]:span_offsets[i + 1]]
        finished [S] uint8: the turn ended with the target's own end-of-turn token
      metadata "rows": JSON list, per row {"id", "turn", "kind", "split"}: the prompt id (a hash
        of the prompt's normalized text, so it also dedupes), the index of its first turn (a
        conversation whose re-rendered history stops matching the ids the target read goes on
        in a new row), its kind and split.

The prompt ids a shard holds live in its own header, not in the manifest, so the manifest stays
small as the corpus grows to hundreds of shards (reading every header is one small read each).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from training import shards

KIND = "specstop-token-corpus"
SCHEMA_VERSION = 1
SUFFIX = ".safetensors"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class TokenRow:
    """One stored sequence: a prompt (or conversation) with the target's turns in it."""

    id: str
    turn: int
    """Index of the first assistant turn in this row (0 unless the conversation was split)."""
    kind: str
    split: str
    ids: list[int]
    spans: list[tuple[int, int, bool]]
    """(start, end, finished) of each target-written turn, relative to the row."""

    @property
    def loss_mask(self) -> np.ndarray:
        m = np.zeros(len(self.ids), dtype=bool)
        for a, b, _ in self.spans:
            m[a:b] = True
        return m


def write_shard(path: Path, rows: list[TokenRow], dtype: str) -> None:
    """One shard file at `path` (the caller writes it to a temp name and renames it)."""
    flat = [t for r in rows for t in r.ids]
    if flat and max(flat) >= np.iinfo(dtype).max + 1:
        raise ValueError(f"token id {max(flat)} does not fit the corpus's {dtype}")
    starts = np.cumsum([0] + [len(r.ids) for r in rows])
    spans = [(int(starts[i]) + a, int(starts[i]) + b) for i, r in enumerate(rows) for a, b, _ in r.spans]
    save_file({
        "tokens": np.asarray(flat, dtype=dtype),
        "offsets": starts.astype(np.int64),
        "spans": np.asarray(spans, dtype=np.int64).reshape(-1, 2),
        "span_offsets": np.cumsum([0] + [len(r.spans) for r in rows]).astype(np.int64),
        "finished": np.asarray([f for r in rows for *_, f in r.spans], dtype=np.uint8),
    }, str(path), metadata={"rows": json.dumps(
        [{"id": r.id, "turn": r.turn, "kind": r.kind, "split": r.split} for r in rows])})


def shard_header(path: Path) -> list[dict]:
    """The per-row metadata of a shard (reads the header only)."""
    try:
        with safe_open(str(path), "np") as f:
            return json.loads((f.metadata() or {})["rows"])
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: unreadable token shard ({e})") from None


def read_shard(path: Path, entry: dict | None = None) -> list[TokenRow]:
    """Every row of one shard; ValueError when it is unreadable or disagrees with its entry."""
    meta = shard_header(path)
    with safe_open(str(path), "np") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    if len(t["offsets"]) != len(meta) + 1 or (entry and entry.get("rows") != len(meta)):
        raise ValueError(f"{path}: row count differs from its header or the manifest")
    out = []
    for i, m in enumerate(meta):
        a, b = int(t["offsets"][i]), int(t["offsets"][i + 1])
        sa, sb = int(t["span_offsets"][i]), int(t["span_offsets"][i + 1])
        spans = [(int(s) - a, int(e) - a, bool(f)) for (s, e), f in zip(t["spans"][sa:sb], t["finished"][sa:sb])]
        out.append(TokenRow(m["id"], m["turn"], m["kind"], m["split"], t["tokens"][a:b].astype(np.int64).tolist(),
                            spans))
    return out


def read_manifest(folder) -> dict | None:
    """The validated manifest of a token corpus (None: no corpus there yet)."""
    return shards.read_manifest(Path(folder), KIND, SCHEMA_VERSION)


def done_prompts(folder, manifest: dict) -> set[str]:
    """Prompt ids held by the finished shards (a rerun skips them)."""
    return {r["id"] for s in manifest["shards"] for r in shard_header(Path(folder) / s["file"])}


def iter_rows(folder) -> Iterator[TokenRow]:
    """Every row of a token corpus, shard by shard: for training, `row.ids` with `row.loss_mask`."""
    m = read_manifest(folder)
    if m is None:
        raise ValueError(f"{folder}: no manifest.json: not a token corpus")
    for s in m["shards"]:
        f = Path(folder) / s["file"]
        if not f.is_file():
            raise ValueError(f"{f}: listed in the manifest but missing")
        yield from read_shard(f, s)


def turn_id(row: TokenRow, j: int) -> str:
    return f"{row.id}@{row.turn + j}"


def turns(row: TokenRow) -> list[tuple[str, list[int], list[int], bool]]:
    """(turn id, prompt ids, completion ids, finished) of each turn: the shape of a teacher corpus
    row (training.corpus.teacher), everything before the turn as its prompt."""
    return [(turn_id(row, j), row.ids[:a], row.ids[a:b], f) for j, (a, b, f) in enumerate(row.spans)]


# --- what the head's data code reads (training.head.cache / data / vocab) -------------------------
def is_token_corpus(folder) -> bool:
    p = Path(folder) / shards.MANIFEST
    try:
        return p.is_file() and json.loads(p.read_text()).get("kind") == KIND
    except ValueError:
        return False


def any_manifest(folder) -> dict | None:
    """A teacher corpus's manifest as is, or a token corpus's seen as one: a shard's `rows` are
    its turns and `prompt_ids` their turn ids (what the feature cache keys its files by)."""
    from training.corpus.teacher import read_manifest as teacher_manifest

    if not is_token_corpus(folder):
        return teacher_manifest(Path(folder))
    m = read_manifest(folder)
    view = []
    for s in m["shards"]:
        ids = turn_ids(Path(folder) / s["file"])
        view.append({**s, "rows": len(ids), "prompt_ids": ids})
    return {**m, "shards": view}


def turn_ids(path: Path) -> list[str]:
    """The turn ids of a shard, from its header and span offsets only."""
    meta = shard_header(path)
    with safe_open(str(path), "np") as f:
        so = f.get_tensor("span_offsets")
    return [f"{m['id']}@{m['turn'] + j}" for i, m in enumerate(meta) for j in range(int(so[i + 1] - so[i]))]


def columns(folder, shard: dict, names: list[str] | None = None) -> dict[str, list]:
    """A shard of either corpus format as teacher-corpus columns (prompt_id, kind, split,
    prompt_ids, completion_ids, finished), one entry per turn."""
    path = Path(folder) / shard["file"]
    if path.suffix != SUFFIX:
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=names).to_pydict()
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "kind", "split", "prompt_ids",
                                             "completion_ids", "finished")}
    for r in read_shard(path):
        for tid, p, c, f in turns(r):
            for k, v in zip(cols, (tid, r.kind, r.split, p, c, f)):
                cols[k].append(v)
    return {k: cols[k] for k in (names or cols)}
