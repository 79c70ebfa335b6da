"""The logged prompts a scheduled retrain reads (training.decider.retrain, and the feature head's
re-distillation in training.head.redistill), their fixed held-out split, the cursor of the files
a retrain has consumed, and the fewest prompts a run needs.

A logged file is `*.jsonl` (names starting with a dot are never read: the server writes into
`.traffic-*.jsonl.part` and renames a file only once it is whole). One row per line:

    {"prompt": "...",                  # required: the text the collect feeds
     "id": "...",                      # optional: default sha256(prompt)[:16]; rows sharing an id count once
     "kind": "general",                # optional: a label kept with the prompt
     "raw": false,                     # optional: true = already what the model reads (never chat-wrapped)
     ...}                              # anything else (time, messages, response) is kept in the file, unread

`python -m decoding.serve --log-prompts DIR` writes exactly this (decoding.serve.traffic_log).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from training.corpus.teacher import Prompt
from training.shards import sha256_file, write_json

CURSOR = "cursor.json"


def logged_files(folder: Path) -> list[Path]:
    return sorted(f for f in Path(folder).glob("*.jsonl") if f.is_file() and not f.name.startswith("."))


def read_logged(folder: Path, files: list[Path] | None = None) -> list[Prompt]:
    """The prompts of `files` (default: every logged file of `folder`), one per id, sorted by id.
    ValueError (one line) on a row without a prompt or when there is none."""
    files = logged_files(folder) if files is None else files
    if not files:
        raise ValueError(f"no new prompt files (*.jsonl) in {folder}")
    seen: dict[str, Prompt] = {}
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["prompt"]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{f}:{i}: not a prompt row (needs a "prompt" string)') from None
            pid = str(row.get("id") or hashlib.sha256(text.encode()).hexdigest()[:16])
            seen.setdefault(pid, Prompt(pid, row.get("kind", "general"), f.stem, text, bool(row.get("raw", False))))
    if not seen:
        raise ValueError(f"the prompt files in {folder} are empty")
    return sorted(seen.values(), key=lambda p: p.id)


def is_heldout(pid: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(f"heldout:{pid}".encode()).digest()[:8], "big") / 2**64 < fraction


# ---- the cursor: which whole files a retrain has consumed ----
def _entry(f: Path) -> dict:
    return {"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)}


def read_cursor(work: Path) -> list[dict]:
    path = Path(work) / CURSOR
    if not path.exists():
        return []
    try:
        return list(json.loads(path.read_text())["consumed"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a retrain cursor (delete it to consume every file again)") from None


def unconsumed(folder: Path, work: Path) -> list[dict]:
    """The logged files of `folder` not in the cursor (a file whose bytes changed counts as new)."""
    done = {(e["name"], e["size"], e["sha256"]) for e in read_cursor(work)}
    out = []
    for f in logged_files(folder):
        e = _entry(f)
        if (e["name"], e["size"], e["sha256"]) not in done:
            out.append(e)
    return out


def consume(work: Path, entries: list[dict]) -> None:
    """Add `entries` to the cursor (atomic: a crash leaves the old cursor or the new one)."""
    cursor = read_cursor(work)
    have = {(e["name"], e["size"], e["sha256"]) for e in cursor}
    cursor += [e for e in entries if (e["name"], e["size"], e["sha256"]) not in have]
    write_json(Path(work) / CURSOR, {"consumed": sorted(cursor, key=lambda e: (e["name"], e["sha256"]))})


# ---- the minimum ----
def split_shares(heldout: float, val: float) -> dict[str, float]:
    """Expected share of the logged prompts in each part a retrain needs non-empty: the held-out
    prompts (judging), and the fit's own train and val splits of the rest."""
    return {"held-out": heldout, "fit train": (1 - heldout) * (1 - val), "fit val": (1 - heldout) * val}


def prompts_floor(heldout: float, val: float) -> int:
    """The fewest prompts at which every part expects at least one prompt."""
    smallest = min(split_shares(heldout, val).values())
    if smallest <= 0:
        raise ValueError(f"heldout_fraction {heldout} and the fit's val_fraction {val} leave a part empty")
    return math.ceil(1 / smallest - 1e-9)


def empty_part(prompts: list[Prompt], heldout: float, val: float, seed: int) -> str | None:
    """The part these exact prompts leave empty (the splits are hashes of the ids), or None."""
    from training.decider.datamodule import prompt_split

    held = [p for p in prompts if is_heldout(p.id, heldout)]
    train = [p for p in prompts if not is_heldout(p.id, heldout)]
    fit_val = sum(prompt_split(p.id, seed, val, 0.0) == "val" for p in train)  # the fit has test_traces: no test part
    counts = {"held-out": len(held), "fit val": fit_val, "fit train": len(train) - fit_val}
    return next((name for name, n in counts.items() if n == 0), None)


def fit_split(fit_config: str, overrides: list[str]) -> tuple[float, int]:
    """The fit's data.val_fraction and data.split_seed: its YAML, then the override flags."""
    import yaml

    val, seed = 0.15, 0
    path = Path(fit_config)
    if path.is_file():
        data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
        data = data.get("init_args", data) if isinstance(data, dict) else {}
        val, seed = float(data.get("val_fraction", val)), int(data.get("split_seed", seed))
    flags = [x for o in overrides for x in (o.split("=", 1) if o.startswith("--") and "=" in o else [o])]
    for flag, value in zip(flags, flags[1:]):
        if flag == "--data.val_fraction":
            val = float(value)
        elif flag == "--data.split_seed":
            seed = int(value)
    return val, seed
