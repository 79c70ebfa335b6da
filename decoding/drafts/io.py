"""specstop's own feature-draft checkpoint: a directory `--draft DIR` recognises by its marker.

    config.json           FeatureDraftConfig (+ "model_type": "specstop_eagle3")
    model.safetensors     the head's weights (EAGLE-3 names: fc, midlayer.*, norm, lm_head, d2t, t2d)
    specstop_draft.json   {"draft_kind": "eagle3", "target": <fingerprint of the target>}

The head has no embeddings of its own (it uses the target's), so it only loads for the target
it was trained on: any other target is refused with one error line. Writes are atomic.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.models.errors import ModelError
from decoding.models.fingerprint import fingerprint, same_model
from decoding.models.weights import DTYPES, make_shareable

MARKER = "specstop_draft.json"
KIND = "eagle3"
MODEL_TYPE = "specstop_eagle3"


def draft_kind(path) -> str:
    """'eagle3' for a feature-draft checkpoint, 'model' for a stand-alone causal LM."""
    marker = Path(path) / MARKER
    if not marker.exists():
        return "model"
    try:
        kind = json.loads(marker.read_text()).get("draft_kind")
    except (OSError, ValueError) as e:
        raise ModelError(f"unreadable {marker}: {e}") from e
    if kind is None:  # a stand-alone draft's specstop_draft.json (head ids, provenance)
        return "model"
    if kind != KIND:
        raise ModelError(f"{marker}: unknown draft_kind {kind!r} (this specstop knows {KIND!r})")
    return kind


def atomic_dir(out: Path, write) -> Path:
    """Write a directory under a temp name, then rename it into place."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write(tmp)
        make_shareable(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_feature_draft(draft: FeatureDraft, out, target, info: dict | None = None) -> Path:
    """Save `draft` for `target` (its fingerprint is recorded); `info` goes into the marker."""
    from safetensors.torch import save_file

    def write(tmp: Path):
        cfg = {"model_type": MODEL_TYPE, **draft.config.to_dict()}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        marker = {"draft_kind": KIND, "target": fingerprint(target), **(info or {})}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")

    return atomic_dir(Path(out), write)


def load_feature_draft(path, target, dtype: str = "float32", device: str = "cpu") -> FeatureDraft:
    """Load a feature draft for `target`; refused (ModelError) when made for another target."""
    from safetensors.torch import load_file

    p = Path(path)
    if draft_kind(p) != KIND:
        raise ModelError(f"{p} is not a feature-draft checkpoint (no {MARKER})")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    marker = json.loads((p / MARKER).read_text())
    want, have = marker.get("target") or {}, fingerprint(target)
    if not same_model(want, have):
        raise ModelError(f"feature draft {p} was trained for target {want.get('name', '?')!r}, not for "
                         f"the loaded target {have['name']!r}: a feature draft only fits its own target")
    try:
        raw = json.loads((p / "config.json").read_text())
        raw.pop("model_type", None)
        cfg = FeatureDraftConfig.from_dict(raw)
        state = load_file(str(p / "model.safetensors"))
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"cannot load feature draft from {p}: {str(e).splitlines()[0]}") from e
    draft = FeatureDraft(cfg)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:  # a head without lm_head must never load silently random
        raise ModelError(f"feature draft {p}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    draft = draft.to(device=device, dtype=DTYPES[dtype]).eval()
    draft.attach_embeddings(target.get_input_embeddings().weight)
    draft.config._name_or_path = str(p)  # as transformers does: fingerprints name the folder
    window = (marker.get("data") or {}).get("window")
    draft.trained_window = int(window) if isinstance(window, int) and window > 0 else None
    return draft


def head_vocab(path) -> torch.Tensor:
    """The target ids of a saved head's draft vocabulary (`arange + d2t`), read without loading
    a target: what re-distilling the head keeps its cache and labels over."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if draft_kind(p) != KIND:
        raise ModelError(f"{p} is not a feature-draft checkpoint (no {MARKER})")
    try:
        with safe_open(str(p / "model.safetensors"), framework="pt") as f:
            d2t = f.get_tensor("d2t").long()
    except (OSError, SafetensorError) as e:
        raise ModelError(f"cannot read the vocabulary of feature draft {p}: {str(e).splitlines()[0]}") from e
    return torch.arange(d2t.numel()) + d2t


def is_feature_draft(model) -> bool:
    return isinstance(model, FeatureDraft)

