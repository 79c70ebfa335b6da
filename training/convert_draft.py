"""Convert old-format specstop drafts (custom model_type) to the standard format, in place.

    python -m training.convert_draft checkpoints/drafts/*

Format 1 stored a `specstop_pruned_llama` config and the kept head ids as an `lm_head.ids`
tensor; format 2 (decoding/drafts/format.py) is a stock LlamaForCausalLM (the same tensors:
the tied embedding was already stored in full) with the ids in specstop_draft.json. Each
directory is rebuilt beside itself and swapped in atomically; a converted one is left as it
is (idempotent). Tensors are moved byte for byte, so every logit is unchanged.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from decoding.drafts.format import (
    DRAFT_META,
    DRAFT_SCHEMA,
    dumps_meta,
    exchange_dirs,
    is_old_format,
    read_meta,
    standard_config,
)

REWRITTEN = ("config.json", "model.safetensors", DRAFT_META)


def convert(d: Path) -> bool:
    """Convert one draft directory; False when it is already in the current format."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    d = Path(d)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise ValueError(f"{d}: not a draft directory (needs config.json and model.safetensors)")
    if not is_old_format(d):
        return False
    raw = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        meta_st = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    ids = state.pop("lm_head.ids", None)
    if ids is None:
        raise ValueError(f"{d}: old-format draft without lm_head.ids in model.safetensors")
    ids = [int(i) for i in ids.tolist()]
    if raw.get("head_size") not in (None, len(ids)):
        raise ValueError(f"{d}: head_size {raw['head_size']} but {len(ids)} stored ids")
    state.pop("lm_head.weight", None)  # tied to the embedding: transformers stores it once
    emb = state["model.embed_tokens.weight"]
    if emb.shape[0] != raw["vocab_size"] or max(ids) >= emb.shape[0] or len(set(ids)) != len(ids):
        raise ValueError(f"{d}: lm_head.ids do not fit the embedding ({tuple(emb.shape)})")

    conf = standard_config(LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"}),
                           emb.dtype)
    meta = read_meta(d)
    meta = {k: v for k, v in meta.items() if k != "head_ids"} | {"schema_version": DRAFT_SCHEMA}
    meta["draft"] = meta.get("draft", {}) | {"head_size": len(ids)}
    if len(ids) < emb.shape[0] or ids != list(range(emb.shape[0])):
        meta["head_ids"] = ids

    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.convert-"))
    try:
        for f in d.iterdir():
            if f.name not in REWRITTEN:
                (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        conf.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata=meta_st or {"format": "pt"})
        (tmp / DRAFT_META).write_text(dumps_meta(meta))
        mode = d.stat().st_mode & 0o777
        tmp.chmod(mode)
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o644)
        exchange_dirs(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def main(argv: list[str] | None = None) -> None:
    from safetensors import SafetensorError

    p = argparse.ArgumentParser(prog="python -m training.convert_draft", description=__doc__.split("\n")[0])
    p.add_argument("drafts", nargs="+", help="draft directories to convert in place")
    a = p.parse_args(argv)
    failed = 0
    for d in a.drafts:
        try:
            done = convert(Path(d))
        except (ValueError, OSError, KeyError, SafetensorError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{d}: {'converted' if done else 'already in the current format'}")
    if failed:
        raise SystemExit(2)


if __name__ == "__main__":
    main()
