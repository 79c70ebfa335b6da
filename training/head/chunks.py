"""Committed training chunks: a training run of the feature head that survives the machine.

Lightning's own last.ckpt (runs/, git-ignored, a pickle) is lost with the machine. A chunk is the
same checkpoint, losslessly re-encoded without pickle so that it can be committed to git and read
on a fresh clone: every tensor (the head's fp32 weights, AdamW's moments, the counters held as
tensors) in safetensors files of about `shard_mib` each (a larger tensor alone in its file), everything else (step, epoch, the
loops' progress with the dataloader's position, the LR scheduler, the callbacks' state, the
run's identity and its held-out scores) in chunk.json. Written to a temp folder and swapped in
(training.swap.replace_dir): a reader, or a run killed mid-write, finds the old chunk or the new.

    checkpoints/training/<run>/latest/   chunk.json + tensors-NNNNN.safetensors
    checkpoints/training/<run>/best/     the best chunk by held-out agreement, as an exported head
    checkpoints/training/<run>/best.json which chunk that was, and its scores

A run resumes from a chunk by turning it back into a Lightning checkpoint (to_lightning) under
runs/: the continuation is Lightning's own resume, from the same state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

CHUNK_JSON = "chunk.json"
SCHEMA = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state that `moments` may store in bfloat16 (the weights stay fp32)."""


class ChunkError(ValueError):
    """A chunk this run cannot continue from (another config, target or vocabulary; damaged)."""


# --- lossless, pickle-free encoding of a checkpoint dict -------------------------------------

def encode(obj, tensors: dict, path: str = "t", moments: str = "float32"):
    """JSON-able skeleton of `obj`; its tensors go into `tensors` under their path. Tuples and
    dicts with non-string keys (AdamW's state is keyed by int) are tagged to come back as such."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared storage
        out = {"$tensor": path, "dtype": str(t.dtype).removeprefix("torch.")}
        if moments == "bfloat16" and path.rsplit(".", 1)[-1] in MOMENTS and t.is_floating_point():
            t = t.to(torch.bfloat16)  # cast back to `dtype` on load
        tensors[path] = t
        return out
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, tensors, f"{path}.{k}", moments) for k, v in obj.items()}
        return {"$dict": [[encode(k, tensors, f"{path}.k{i}", moments), encode(v, tensors, f"{path}.{k}", moments)]
                          for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, tensors, f"{path}.{i}", moments) for i, v in enumerate(obj)]
        return {"$tuple": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a checkpoint entry at {path} is a {type(obj).__name__}: not storable without pickle")


def decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        return tensors[obj["$tensor"]].to(getattr(torch, obj["dtype"]))
    if "$tuple" in obj:
        return tuple(decode(v, tensors) for v in obj["$tuple"])
    if "$dict" in obj:
        return {decode(k, tensors): decode(v, tensors) for k, v in obj["$dict"]}
    return {k: decode(v, tensors) for k, v in obj.items()}


# --- the callbacks' paths, relative to the working directory -------------------------------------

CWD = "$cwd"
"""Stands for the working directory in the callbacks' paths (ModelCheckpoint's dirpath and
best_k_models): a committed chunk names no machine's folder, and a clone elsewhere gets its own."""


def relocated(obj, old: str, new: str):
    """`obj` with every string (and dict key) that is `old` or under it starting with `new` instead."""
    if isinstance(obj, str):
        return new + obj[len(old):] if obj == old or obj.startswith(old + os.sep) else obj
    if isinstance(obj, dict):
        return {relocated(k, old, new): relocated(v, old, new) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(relocated(v, old, new) for v in obj)
    return obj


def _cwd() -> str:
    return os.path.realpath(os.getcwd())  # ModelCheckpoint keeps realpaths


# --- write / read -------------------------------------------------------------------------------

def _shards(tensors: dict, limit: int) -> list[dict]:
    out, cur, size = [], {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > limit:
            out.append(cur)
            cur, size = {}, 0
        cur[k], size = t, size + n
    return out + [cur] if cur else out


def write_chunk(out: Path, ckpt: dict, meta: dict, moments: str = "float32", shard_mib: float = 15) -> Path:
    """Write the Lightning checkpoint dict `ckpt` and `meta` as a chunk at `out`, atomically."""
    from safetensors.torch import save_file

    from decoding.models import make_shareable
    from training.swap import replace_dir

    if moments not in ("float32", "bfloat16"):
        raise ValueError(f"chunk moments must be float32 or bfloat16 (got {moments!r})")
    tensors: dict = {}
    if "callbacks" in ckpt:
        ckpt = ckpt | {"callbacks": relocated(ckpt["callbacks"], _cwd(), CWD)}
    skeleton = encode(ckpt, tensors, moments=moments)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        files = {}
        for i, part in enumerate(_shards(tensors, int(shard_mib * 2**20))):
            name = f"tensors-{i:05d}.safetensors"
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            files[name] = {"tensors": list(part), "sha256": _sha256(tmp / name),
                           "bytes": (tmp / name).stat().st_size}
        sizes = {"model": sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("t.state_dict.")),
                 "optimizer": sum(t.numel() * t.element_size() for k, t in tensors.items()
                                  if k.startswith("t.optimizer_states."))}
        doc = {"kind": "specstop-training-chunk", "schema_version": SCHEMA, "moments": moments,
               "files": files, "bytes": sizes, **meta, "checkpoint": skeleton}
        (tmp / CHUNK_JSON).write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")
        make_shareable(tmp)  # mkdtemp's folder is private
        replace_dir(tmp, out)  # one swap: the old chunk stays whole until the new one is
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_meta(folder: Path) -> dict | None:
    """chunk.json without the tensors (None where no chunk is)."""
    p = Path(folder) / CHUNK_JSON
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise ChunkError(f"{p}: not valid JSON ({e})") from None
    if doc.get("kind") != "specstop-training-chunk" or doc.get("schema_version") != SCHEMA:
        raise ChunkError(f"{p}: not a training chunk of schema {SCHEMA}")
    return doc


def read_chunk(folder: Path) -> tuple[dict, dict]:
    """(the Lightning checkpoint dict, chunk.json) of a chunk; every file's sha256 checked."""
    from safetensors.torch import load_file

    doc = read_meta(folder)
    if doc is None:
        raise ChunkError(f"{folder}: no {CHUNK_JSON}")
    tensors = {}
    for name, info in doc["files"].items():
        f = Path(folder) / name
        if not f.is_file() or _sha256(f) != info["sha256"]:
            raise ChunkError(f"{f}: missing or not the file the chunk was written with")
        tensors |= load_file(str(f))
    ckpt = decode(doc["checkpoint"], tensors)
    if "callbacks" in ckpt:
        ckpt["callbacks"] = relocated(ckpt["callbacks"], CWD, _cwd())
    return ckpt, doc


def to_lightning(folder: Path, out: Path) -> Path:
    """The chunk as a Lightning checkpoint file (for trainer.fit(ckpt_path=...)); tensors and
    plain types only, so it loads with weights_only=True."""
    ckpt, _ = read_chunk(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(ckpt, tmp)
    tmp.replace(out)
    return out


# --- identity -----------------------------------------------------------------------------------

VARIES = ("warm_start", "head", "trained_window", "teacher_dtype")
"""Module settings a continuation may differ in: warm_start only seeds a run's first session
(a chunk's weights replace it), head and trained_window are derived from the data, and
teacher_dtype is where it runs (the same rows, labelled at another precision)."""


def identity(module, data, trainer) -> dict:
    """What a chunk must share with the run continuing it: the target, the draft vocabulary, the
    head's shape and every setting that shapes the loss, the data order or the schedule. Free to
    differ: where it runs (accelerator, precision, threads, workers), the feature source (cached
    or online: the same rows), how long a session lasts and how often chunks are written."""
    from training.corpus.teacher import target_fingerprint

    data_keys = ("corpora", "draft_vocab_size", "k", "layers", "max_prompt_tokens", "max_tokens",
                 "val_percent", "max_val_rows", "max_rows", "seed", "vocab_from")
    names = {"draft_vocab_size": "vocab_size"}
    kept = {k: getattr(data, names.get(k, k)) for k in data_keys}
    if getattr(data, "train_from", None):  # absent, not empty, in runs made before it existed
        kept["train_from"] = dict(data.train_from)
    return {"target": target_fingerprint(module.hp["target"]),
            "vocab_sha256": data.vocab.sha256(),
            "model": {k: v for k, v in module.hp.items() if k not in VARIES},
            "data": kept,
            "trainer": {"max_steps": trainer.max_steps, "accumulate_grad_batches": trainer.accumulate_grad_batches,
                        "gradient_clip_val": trainer.gradient_clip_val}}


def longer_wsd(doc: dict, mine: dict) -> bool:
    """Whether `mine` differs from the chunk's run only in trainer.max_steps, under a wsd schedule,
    with the chunk before the decay under both lengths: every lr it has used (and the one its
    optimizer holds for the next step) is then the longer run's too, so the continuation is that
    run's, as if it had been planned so from the start."""
    theirs = doc.get("identity") or {}
    if any(theirs.get(k) != mine.get(k) for k in ("target", "vocab_sha256", "model", "data")):
        return False
    a, b = dict(theirs.get("trainer") or {}), dict(mine.get("trainer") or {})
    old, new = a.pop("max_steps", None), b.pop("max_steps", None)
    model = mine.get("model") or {}
    if a != b or model.get("schedule") != "wsd" or not (old and new and old > 0 and new > 0):
        return False
    return doc.get("global_step", math.inf) < min(old, new) - model["decay_steps"]


def check_identity(doc: dict, mine: dict, folder) -> None:
    """One line naming the first difference where the chunk was made for another run (a wsd run
    made longer or shorter before its decay is the same run: longer_wsd)."""
    theirs = doc.get("identity") or {}
    if longer_wsd(doc, mine):
        return
    for part in ("target", "vocab_sha256", "model", "data", "trainer"):
        a, b = theirs.get(part), mine.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            what = (f"target {a.get('name')!r} ({key} differs)" if part == "target"
                    else f"{part}.{key} = {a.get(key)!r}, this run's {b.get(key)!r}")
        else:
            what = f"{part} {str(a)[:16]}…, this run's {str(b)[:16]}…"
        raise ChunkError(f"{folder} was made for another run ({what}): continue it with its own "
                         "config, or give this run another run.name")


def manifests(corpora: list[str]) -> dict:
    """Each corpus's manifest.json sha256: the data a chunk was trained on (growth is allowed)."""
    out = {}
    for c in corpora:
        p = Path(c) / "manifest.json"
        out[c] = _sha256(p) if p.is_file() else None
    return out


def finite(x):
    """JSON-safe float (NaN and infinities as None)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x
