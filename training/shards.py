"""A directory of parquet shards plus a manifest: atomic, resumable, one writer at a time.

Shared by the teacher corpus and the trace sets. A shard is written to a temp file and
renamed, then the manifest is rewritten the same way, so a shard is either complete and
listed or ignored; on open, leftovers of an interrupted run are removed and the keys
already done (prompt ids) are skipped by the caller.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    atomic_write(Path(path), lambda p: p.write_text(json.dumps(obj, indent=1) + "\n"))


def write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda p: p.write_text(text))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest(folder: Path, kind: str, version: int) -> dict | None:
    """The validated manifest of `folder`, None if there is none; ValueError if it is wrong."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("kind") != kind:
        raise ValueError(f"{path}: not a {kind} manifest")
    if m.get("schema_version") != version:
        raise ValueError(f"{path}: {kind} schema version {m.get('schema_version')!r}, this code "
                         f"reads version {version}; regenerate it")
    if not isinstance(m.get("shards"), list):
        raise ValueError(f"{path}: manifest has no shard list")
    return m


class ShardWriter:
    """Appends shards to a directory whose manifest pins `identity` (model pair, settings)."""

    def __init__(self, folder, kind: str, version: int, identity: dict, suffix: str = ".parquet"):
        self.folder = Path(folder)
        self.kind, self.version, self.identity = kind, version, identity
        self.suffix = suffix
        """Shard file extension: unlisted `shard-*<suffix>` files are leftovers of a killed run."""

    def __enter__(self) -> ShardWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ValueError(f"another writer is running on {self.folder}") from None
        m = read_manifest(self.folder, self.kind, self.version)
        self.manifest = m or {"kind": self.kind, "schema_version": self.version, **self.identity,
                              "shards": []}
        for key, now in self.identity.items():  # mixing models or settings would corrupt it
            if self.manifest.get(key) != now:
                raise ValueError(f"{self.folder} was written with another {key} "
                                 f"({self.manifest.get(key)}); use another output directory")
        listed = {s["file"] for s in self.manifest["shards"]}
        for stale in [*self.folder.glob(".*.tmp-*"), *self.folder.glob(f"shard-*{self.suffix}")]:
            if stale.name not in listed:
                stale.unlink()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.close()

    def done(self) -> set[str]:
        return {k for s in self.manifest["shards"] for k in s["prompt_ids"]}

    def write(self, table: pa.Table, prompt_ids: list[str], **extra) -> str:
        return self.add(lambda p: pq.write_table(table, p, compression="zstd"), rows=table.num_rows,
                        prompt_ids=list(prompt_ids), **extra)

    def add(self, write: Callable[[Path], None], sized: bool = False, **entry) -> str:
        """Write the next shard with `write(path)`, then list it with `entry` (and its size in
        `bytes` when `sized`) in the manifest."""
        idx = 1 + max((int(s["file"][6:11]) for s in self.manifest["shards"]), default=-1)
        name = f"shard-{idx:05d}{self.suffix}"
        atomic_write(self.folder / name, write)
        size = {"bytes": (self.folder / name).stat().st_size} if sized else {}
        self.manifest["shards"].append({"file": name, **entry, **size})
        write_json(self.folder / MANIFEST, self.manifest)
        return name


def read_shards(folder, kind: str, version: int, schema: pa.Schema) -> tuple[dict, pa.Table]:
    """(manifest, all rows) of one shard directory; ValueError on any inconsistency."""
    m = read_manifest(Path(folder), kind, version)
    if m is None:
        raise ValueError(f"{folder}: no {MANIFEST}: not a {kind} directory")
    tables = []
    for s in m["shards"]:
        f = Path(folder) / s["file"]
        if not f.is_file():
            raise ValueError(f"{f}: listed in the manifest but missing")
        try:
            t = pq.read_table(f)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"{f}: unreadable shard ({e})") from None
        if not t.schema.equals(schema) or t.num_rows != s["rows"]:
            raise ValueError(f"{f}: schema or row count differs from the manifest")
        tables.append(t)
    return m, (pa.concat_tables(tables) if tables else schema.empty_table())
