"""Rewrite model fingerprints recorded by an older scheme into the current one.

    python -m training.migrate_fingerprints [--model DIR ...] [PATH ...]

Deciders, trace sets, corpus manifests and draft metadata record which model they were made
with (decoding.models.fingerprint). Version 1 hashed the whole config dict, so a transformers
upgrade (or the draft format change) made every record stale. Each version-1 record is
matched to one of the given models by its embedding sample hash and vocabulary size, then
replaced by that model's current fingerprint (its name and extra keys kept). Records that
match no given model are left as they are and listed. Files are rewritten atomically; the
sha256 of a rewritten file is updated where other scanned files cite it (provenance).
Defaults: the default target and every draft under checkpoints/drafts; PATHs
checkpoints/deciders, checkpoints/drafts and data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

NAMES = ("config.json", "metrics.json", "manifest.json", "specstop_draft.json")
V1_KEYS = ("config_sha256", "embed_sha256")


def v1_embed_sha256(model) -> str:
    """What version 1 hashed of the weights: the first 512 embedding rows, rounded to bf16."""
    import torch

    emb = model.get_input_embeddings().weight[:512].detach().to(torch.bfloat16).float().cpu()
    return hashlib.sha256(emb.numpy().tobytes()).hexdigest()


def known_models(dirs: list[str]) -> dict[tuple[str, int], dict]:
    """(v1 embedding hash, vocab size) -> current fingerprint, for each model directory."""
    from decoding.models import fingerprint, load_model

    out = {}
    for d in dirs:
        m = load_model(d, "bfloat16")
        fp = fingerprint(m)
        out[(v1_embed_sha256(m), fp["vocab_size"])] = fp
    return out


def migrate_obj(obj, models: dict, unmatched: list) -> bool:
    """Replace version-1 fingerprints inside a JSON value in place; True if any changed."""
    changed = False
    if isinstance(obj, dict):
        if "embed_sha256" in obj and "fingerprint_version" not in obj:
            fp = models.get((obj["embed_sha256"], obj.get("vocab_size")))
            if fp is None:
                unmatched.append(obj.get("name"))
                return False
            keep = {k: v for k, v in obj.items() if k not in V1_KEYS}
            obj.clear()
            obj.update(keep | {k: fp[k] for k in ("fingerprint_version", "config_sha256", "weights_sha256")})
            return True
        for v in obj.values():
            changed |= migrate_obj(v, models, unmatched)
    elif isinstance(obj, list):
        for v in obj:
            changed |= migrate_obj(v, models, unmatched)
    return changed


def _dump(obj, like: str) -> str:
    from decoding.drafts.format import dumps_meta

    text = dumps_meta(obj) if isinstance(obj, dict) else json.dumps(obj, indent=1) + "\n"
    return text if like.endswith("\n") else text.rstrip("\n")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def files_under(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += [p] if p.is_file() else sorted(f for f in p.rglob("*.json") if f.name in NAMES)
    return out


def migrate(paths: list[Path], models: dict) -> tuple[list[Path], list]:
    """Rewrite each file whose fingerprints are stale; returns (changed files, unmatched names)."""
    unmatched: list = []
    texts = {p: p.read_text() for p in paths}
    new_texts, sha_map = {}, {}
    for p, text in texts.items():
        obj = json.loads(text)
        if migrate_obj(obj, models, unmatched):
            new_texts[p] = _dump(obj, text)
            sha_map[hashlib.sha256(text.encode()).hexdigest()] = hashlib.sha256(new_texts[p].encode()).hexdigest()
    for p, text in texts.items():  # provenance: files that cite a rewritten file by its sha256
        cur = new_texts.get(p, text)
        for old, new in sha_map.items():
            cur = cur.replace(f'"{old}"', f'"{new}"')
        if cur != text:
            new_texts[p] = cur
    for p, text in new_texts.items():
        _write(p, text)
    return sorted(new_texts), unmatched


def main(argv: list[str] | None = None) -> None:
    from decoding.models import DEFAULT_TARGET, ModelError

    p = argparse.ArgumentParser(prog="python -m training.migrate_fingerprints",
                                description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", default=["checkpoints/deciders", "checkpoints/drafts", "data"])
    p.add_argument("--model", action="append", help="model directory the records may refer to "
                   "(repeatable; default: the default target + checkpoints/drafts/*)")
    a = p.parse_args(argv)
    dirs = a.model or [DEFAULT_TARGET] + sorted(str(d) for d in Path("checkpoints/drafts").glob("*")
                                                if (d / "config.json").is_file())
    try:
        models = known_models(dirs)
        changed, unmatched = migrate(files_under(a.paths), models)
    except (ModelError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    for f in changed:
        print(f"migrated {f}")
    if unmatched:
        print(f"left as is (no --model matches): {', '.join(sorted(set(map(str, unmatched))))}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
