"""The logged prompts a scheduled retrain reads (training.decider.retrain, and the feature head's
re-distillation in training.head.redistill), and their fixed held-out split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from training.corpus.teacher import Prompt


def read_logged(folder: Path) -> list[Prompt]:
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
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
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{f}:{i}: not a prompt row (needs a "prompt" field)') from None
            pid = str(row.get("id") or hashlib.sha256(text.encode()).hexdigest()[:16])
            seen.setdefault(pid, Prompt(pid, row.get("kind", "general"), f.stem, text))
    if not seen:
        raise ValueError(f"the prompt files in {folder} are empty")
    return sorted(seen.values(), key=lambda p: p.id)


def is_heldout(pid: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(f"heldout:{pid}".encode()).digest()[:8], "big") / 2**64 < fraction
