"""Resolve a target or draft name to a Hugging Face model directory: the embedded default, a
named target, a GGUF file (each converted once into the cache) or a directory as given."""

from __future__ import annotations

import os
from pathlib import Path

from decoding.models.errors import ModelError
from decoding.models.named_targets import NAMED, default_target_dir, gguf_target_dir, named_target_dir, smollm2_gguf_path
from decoding.options import DEFAULT_TARGET


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    if path is None or str(path) == DEFAULT_TARGET:
        return default_target_dir()
    if str(path) in NAMED:
        return named_target_dir(str(path))
    if str(path).endswith(".gguf"):
        return gguf_target_dir(Path(path))
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model directory not found: {p}")
    if not (p / "config.json").exists():
        raise ModelError(f"not a Hugging Face model directory (no config.json): {p}")
    return p


def gguf_source(path: str | os.PathLike | None) -> Path | None:
    """The GGUF file a target comes from (the embedded default, a .gguf path), else None."""
    if path is None or str(path) == DEFAULT_TARGET:
        return smollm2_gguf_path()
    return Path(path) if str(path).endswith(".gguf") else None


def from_gguf(path) -> bool:
    """The target was converted from a GGUF (a named target's lives in its packages)."""
    return gguf_source(path) is not None or str(path) in NAMED
