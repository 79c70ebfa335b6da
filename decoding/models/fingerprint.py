"""Identity of a model's weights, recorded by deciders, trace sets, corpora and drafts.

Version 2 hashes only what defines the weights (architecture, sizes, layer and head counts,
rope settings, tie flag, a draft's head ids) plus an evenly spaced sample of every weight
tensor, so a transformers upgrade that adds config keys, or a reload in another dtype, keeps
it. Version-1 records (the whole config dict) migrate: `python -m training.migrate_fingerprints`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

FINGERPRINT_VERSION = 2
"""2: weight-defining config fields + a sample of every weight tensor (1: whole config dict)."""
_WEIGHT_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
                       "layer_norm_eps", "tie_word_embeddings")
_NEUTRAL = {"attention_bias": False, "mlp_bias": False, "partial_rotary_factor": 1.0,
            "sliding_window": None}
"""Keys a transformers version may lack or add with this default: hashed only when they differ."""
_SAMPLE = 1024
"""Elements hashed per weight tensor (evenly spaced, rounded to bf16)."""


def _rope(config) -> dict:
    """Rope settings in one shape whether a transformers version keeps `rope_theta` at the top
    level (+ `rope_scaling`) or in `rope_parameters`."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    if getattr(config, "rope_theta", None) is not None:
        rope.setdefault("rope_theta", config.rope_theta)
    rope.setdefault("rope_type", "default")
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in rope.items()}


def weight_config(model) -> dict:
    """The config fields that define a model's weights and what they compute; loader
    bookkeeping and keys a newer transformers adds do not change it."""
    c = model.config
    # a draft's own kinds describe themselves, so this room never imports decoding.drafts
    if getattr(c, "fingerprint_architecture", None) == "eagle3":  # a feature head's typed config
        d = dataclasses.asdict(c)
        d.pop("extra", None)
        if d.get("embed_scale") == 1.0:  # the neutral default: heads saved before it keep their identity
            d.pop("embed_scale")
        return {"architecture": "eagle3", **d}
    arch = getattr(c, "fingerprint_architecture", c.model_type)  # a pruned-head draft: "llama"
    out = {"architecture": arch, "rope": _rope(c)}
    out |= {k: getattr(c, k) for k in _WEIGHT_CONFIG_KEYS if getattr(c, k, None) is not None}
    out |= {k: getattr(c, k) for k, v in _NEUTRAL.items() if getattr(c, k, v) != v}
    # head_dim: an explicit key in newer configs, derived in older ones
    out["head_dim"] = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # a pruned draft proposes only its head's ids (decoding.drafts.pruned.PrunedHead): part of its identity
    ids = getattr(model.get_output_embeddings(), "ids", None)
    out["head_ids_sha256"] = (None if ids is None else
                              hashlib.sha256(ids.cpu().to(torch.int64).numpy().tobytes()).hexdigest())
    return out


@torch.no_grad()
def weights_sample_sha256(model) -> str:
    """Hash of every weight tensor's name, shape and an evenly spaced sample of its values
    rounded to bf16 (so fp32 and bf16 loads of one checkpoint agree). A model whose head was
    re-cast after loading (`decoding.models.weights.set_head_dtype`) keeps the hash of the weights it loaded."""
    if getattr(model, "_loaded_weights_sha256", None):
        return model._loaded_weights_sha256
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
        flat = p.detach().reshape(-1)
        n, k = flat.numel(), min(_SAMPLE, flat.numel())
        idx = torch.arange(k, device=flat.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
        vals = flat[idx].to(torch.bfloat16).float().cpu().numpy()
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(vals.tobytes())
    return h.hexdigest()


def fingerprint(model, name: str | None = None) -> dict:
    """Identity of a model's weights: the same whatever dtype it was loaded in and whatever
    transformers version wrote its config. Deciders and corpora record it; a checkpoint for
    another model pair is refused."""
    conf = json.dumps(weight_config(model), sort_keys=True, default=str)
    return {
        "name": name or Path(str(getattr(model.config, "_name_or_path", "") or "model")).name,
        "fingerprint_version": FINGERPRINT_VERSION,
        "config_sha256": hashlib.sha256(conf.encode()).hexdigest(),
        "weights_sha256": weights_sample_sha256(model),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }


def same_model(a: dict, b: dict) -> bool:
    keys = ("fingerprint_version", "config_sha256", "weights_sha256", "vocab_size")
    return all(a.get(k) == b.get(k) for k in keys)


def stale_fingerprint(fp: dict) -> bool:
    """A fingerprint recorded by an older scheme: compare after `python -m
    training.migrate_fingerprints`, never across schemes."""
    return fp.get("fingerprint_version") != FINGERPRINT_VERSION
