"""How a specstop draft is stored: a plain Hugging Face `LlamaForCausalLM` + specstop_draft.json.

The draft's output layer scores only the target's frequent tokens (a row selection of the
tied embedding, see `decoding.drafts.pruned.PrunedHead`). On disk the model stays standard: full
tied embedding, stock config.json, so `AutoModelForCausalLM.from_pretrained(dir)` loads it
anywhere (e.g. as `assistant_model=` of `model.generate`). The kept ids live in
specstop_draft.json (`head_ids`) and `decoding.models.load_model` applies them at load time.

Format 1 (before this module) stored a custom `model_type` with the ids as a tensor:
`python -m training.convert_draft DIR` converts such a directory in place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

DRAFT_META = "specstop_draft.json"
DRAFT_SCHEMA = 2
"""specstop_draft.json schema: 2 = standard Llama weights + `head_ids` here (1 = custom model_type)."""
OLD_MODEL_TYPE = "specstop_pruned_llama"
# keys the old custom config carried on top of a LlamaConfig, or that the loader rewrites
_CUSTOM_CONFIG_KEYS = ("head_size", "model_type", "architectures", "transformers_version")


class OldDraftFormat(ValueError):
    """A format-1 draft directory (custom model_type); the message says how to convert it."""


def read_meta(d: Path) -> dict:
    p = Path(d) / DRAFT_META
    return json.loads(p.read_text()) if p.is_file() else {}


def head_ids_of(d: Path) -> list[int] | None:
    """Kept output ids recorded for a draft directory (None: a full output layer)."""
    ids = read_meta(d).get("head_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
        raise ValueError(f"{Path(d) / DRAFT_META}: head_ids must be a list of token ids")
    return ids


def is_old_format(d: Path) -> bool:
    p = Path(d) / "config.json"
    try:
        return json.loads(p.read_text()).get("model_type") == OLD_MODEL_TYPE
    except (OSError, ValueError):
        return False


def refuse_old_format(d: Path) -> None:
    if is_old_format(d):
        raise OldDraftFormat(
            f"{d} is an old-format specstop draft (model_type {OLD_MODEL_TYPE!r}): convert it "
            f"once with `python -m training.convert_draft {d}`")


def standard_config(config, dtype: torch.dtype):
    """The LlamaConfig a pruned-head draft config stands for (no custom keys)."""
    from transformers import LlamaConfig

    d = {k: v for k, v in config.to_dict().items() if k not in _CUSTOM_CONFIG_KEYS}
    conf = LlamaConfig(**d)
    conf.architectures = ["LlamaForCausalLM"]
    conf.dtype = dtype
    return conf


def dumps_meta(meta: dict) -> str:
    """specstop_draft.json text: indented, but the (long) id list on one line."""
    ids = meta.get("head_ids")
    if ids is None:
        return json.dumps(meta, indent=1) + "\n"
    text = json.dumps(meta | {"head_ids": "@IDS@"}, indent=1)
    return text.replace('"@IDS@"', json.dumps([int(i) for i in ids], separators=(",", ":"))) + "\n"


def write_head_ids(out: Path, ids: list[int] | None) -> None:
    """Record the kept ids in `out`/specstop_draft.json (other metadata kept; atomic)."""
    meta = {k: v for k, v in read_meta(out).items() if k != "head_ids"}
    meta |= {"schema_version": DRAFT_SCHEMA} | ({"head_ids": ids} if ids is not None else {})
    tmp = Path(out) / f".{DRAFT_META}.tmp-{os.getpid()}"
    tmp.write_text(dumps_meta(meta))
    os.replace(tmp, Path(out) / DRAFT_META)


def exchange_dirs(new: Path, out: Path) -> None:
    """Put directory `new` at `out`; the previous `out` (if any) is removed. On Linux the
    swap is one atomic renameat2(RENAME_EXCHANGE): readers see the old or the new tree."""
    import shutil

    if out.exists() and _renameat2_exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old tree
        return
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
