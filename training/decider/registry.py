"""`registry.json` in a deciders root: every exported run with its headline metrics, and
`latest` (a run-id = subdirectory name) that `decoding.decider.policy.load_decider('latest')` reads.

Updates take an exclusive lock (concurrent fits must not lose each other's entries) and
replace the file atomically (temp file + fsync + os.replace), so a reader sees the old or
the new registry, never a partial one.
"""

from __future__ import annotations

import fcntl
import json
from contextlib import contextmanager
from pathlib import Path

from training.shards import write_json

REGISTRY = "registry.json"


def read_registry(root) -> dict:
    """{"latest": run-id | None, "runs": [info, ...]}; ValueError if the file is corrupt."""
    path = Path(root) / REGISTRY
    if not path.exists():
        return {"latest": None, "runs": []}
    try:
        reg = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: corrupt registry ({e})") from None
    if not isinstance(reg, dict) or not isinstance(reg.get("runs"), list):
        raise ValueError(f"{path}: not a decider registry (needs a 'runs' list)")  # noqa: TRY004
    reg.setdefault("latest", None)
    return reg


@contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".registry.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks: registering is quick
        yield


class LatestMoved(RuntimeError):
    """`latest` is no longer the run a compare-and-swap promotion was judged against."""


_ANY = object()


def register(root, run_id: str, info: dict, promote: bool = True, expect_latest=_ANY) -> dict:
    """Add (or replace) run `run_id` and, if `promote`, make it `latest`. Returns the registry.

    expect_latest: compare-and-swap; under the lock, refuse (LatestMoved, nothing written)
    unless `latest` is still this run id (None = no champion yet)."""
    root = Path(root)
    if not (root / run_id / "config.json").is_file():
        raise ValueError(f"{root / run_id}: not an exported decider (no config.json)")
    with _locked(root):
        reg = read_registry(root)
        if expect_latest is not _ANY and reg["latest"] != expect_latest:
            raise LatestMoved(f"{root / REGISTRY}: latest is now {reg['latest']!r}, not the "
                              f"{expect_latest!r} this run was compared against")
        reg["runs"] = [r for r in reg["runs"] if r.get("run_id") != run_id] + [{"run_id": run_id, **info}]
        if promote:
            reg["latest"] = run_id
        write_json(root / REGISTRY, reg)
    return reg
