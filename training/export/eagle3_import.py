"""Read an EAGLE-3 head written for a serving engine back into specstop (`from_eagle3`).

Accepted layouts: ours and vLLM / SGLang's (`LlamaForCausalLMEagle3`, `midlayer.*`), the
official EAGLE-3 checkpoints (`LlamaForCausalLM` with `draft_vocab_size`, weights possibly in
`pytorch_model.bin`, read with weights_only) and the `speculators` layout (`speculators_config`,
`transformer_layer_config`, `layers.0.*`). Whatever would wire the head differently from
specstop's FeatureDraft is refused with one ModelError line, never loaded silently: a norm
before the residual or before `fc`, per-layer fc norms, a post-norm aux output, a tied or
scaled head, biases, RoPE scaling, more than one layer. `eagle_aux_hidden_state_layer_ids`
(top level or in `eagle_config`; vLLM's convention, the INPUT of layer i, as our pre-hooks)
sets the layers the head reads; absent, the engines' default (2, L // 2, L - 3).
Missing `d2t` / `t2d` mean a full-vocabulary head; `embed_tokens` is ignored (the target's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig, default_aux_layers
from decoding.models import DTYPES, ModelError
from decoding.models.target_layout import target_layout

ARCH = "LlamaForCausalLMEagle3"
# config flags whose non-default value means a head built unlike ours: (key, the value we are)
WIRING = (("norm_before_residual", False), ("norm_before_fc", False), ("fc_norm", False),
          ("norm_output", False), ("tie_word_embeddings", False), ("attention_bias", False),
          ("mlp_bias", False), ("use_aux_hidden_state", True), ("logit_scale", 1.0),
          ("hidden_act", "silu"), ("num_hidden_layers", 1))


def read_config(p: Path) -> dict:
    """The head's Llama-style config, flattened out of the speculators layout when it is one."""
    try:
        c = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read an EAGLE-3 draft from {p}: {str(e).splitlines()[0]}") from e
    if "speculators_config" in c or "speculators_model_type" in c:
        if c.get("speculators_model_type") != "eagle3":
            raise ModelError(f"{p}: a speculators {c.get('speculators_model_type')!r} model, not eagle3")
        layer = dict(c.get("transformer_layer_config") or {})
        # speculators' own default for norm_before_residual is true (vLLM reads it so too)
        extra = {k: v for k, v in c.items() if k not in ("transformer_layer_config", "speculators_config",
                                                          "architectures", "auto_map")}
        return layer | extra | {"norm_before_residual": c.get("norm_before_residual", True),
                                "architectures": [ARCH]}
    archs = c.get("architectures") or []
    if ARCH in archs:
        return c
    if "LlamaForCausalLM" in archs and "draft_vocab_size" in c:  # official EAGLE-3 checkpoints
        return c
    raise ModelError(f"{p}: not an EAGLE-3 draft (architectures {archs})")


def check_wiring(p: Path, c: dict) -> None:
    eagle = c.get("eagle_config") or {}
    for key, ours in WIRING:
        have = eagle.get(key, c.get(key, ours))
        if have is None and key == "logit_scale":
            have = ours
        if have != ours:
            raise ModelError(f"{p}: {key} = {have!r}; specstop's head is built with {ours!r} and "
                             "would run it mis-wired")
    if c.get("rope_scaling"):
        raise ModelError(f"{p}: rope_scaling {c['rope_scaling']} is not supported (plain RoPE only)")


def aux_layer_ids(p: Path, c: dict, n_layers: int) -> tuple[int, ...]:
    ids = c.get("eagle_aux_hidden_state_layer_ids") or (c.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layers(n_layers)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < n_layers for i in ids):
        raise ModelError(f"{p}: eagle_aux_hidden_state_layer_ids {ids} must be 3 layers of the "
                         f"target's {n_layers}")
    return tuple(ids)


def read_weights(p: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        files = sorted(p.glob("*.safetensors"))
        if files:
            state = {k: v for f in files for k, v in load_file(str(f)).items()}
        elif (p / "pytorch_model.bin").is_file():
            state = torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise OSError("no model.safetensors or pytorch_model.bin")
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot read an EAGLE-3 draft from {p}: {str(e).splitlines()[0]}") from e
    out = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        if k.startswith("layers.0."):  # speculators' name for the one decoder layer
            k = "midlayer." + k.removeprefix("layers.0.")
        elif k.startswith("layers."):
            raise ModelError(f"{p}: weight {k}: more than one decoder layer")
        out[k] = v
    out.pop("embed_tokens.weight", None)  # the target's own embeddings are used
    return out


def head_config(p: Path, c: dict, n: int) -> FeatureDraftConfig:
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return FeatureDraftConfig(
        hidden_size=c["hidden_size"], target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        target_num_layers=n, aux_layers=aux_layer_ids(p, c, n), num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        draft_vocab_size=c.get("draft_vocab_size") or c["vocab_size"], rope_theta=float(rope),
        rms_norm_eps=c["rms_norm_eps"], max_position_embeddings=c["max_position_embeddings"])


def from_eagle3(path, target, dtype: str = "float32") -> FeatureDraft:
    """Read an EAGLE-3 serving directory back into a FeatureDraft for `target`."""
    p = Path(path)
    c = read_config(p)
    check_wiring(p, c)
    tc = target.config
    hidden = c.get("target_hidden_size") or c.get("hidden_size")
    if hidden != tc.hidden_size or c.get("vocab_size") != tc.vocab_size:
        raise ModelError(f"{p}: made for a target with hidden {hidden} and vocab {c.get('vocab_size')}, "
                         f"not {tc.hidden_size} / {tc.vocab_size}")
    n = tc.num_hidden_layers
    try:
        cfg = head_config(p, c, n)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{p}: unusable EAGLE-3 config ({type(e).__name__}: {e})") from e
    cfg.embed_scale = target_layout(target).embed_scale  # not in the format: the target's own
    state = read_weights(p)
    draft = FeatureDraft(cfg)
    if "d2t" not in state and "t2d" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ModelError(f"{p}: no d2t / t2d for a reduced draft vocabulary of {cfg.draft_vocab_size}")
        state |= {"d2t": draft.d2t.clone(), "t2d": draft.t2d.clone()}  # full vocabulary: identity
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:  # a head without lm_head must never load silently random
        raise ModelError(f"{p}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    draft = draft.to(DTYPES[dtype]).eval()
    draft.attach_embeddings(target.get_input_embeddings().weight)
    return draft
