"""Export a specstop draft for other serving engines.

    python -m training.export --format eagle3 --draft DIR --out DIR [--target DIR] [--dtype bfloat16]

`eagle3` writes the layout vLLM (`speculative_config={"method": "eagle3", "model": DIR,
"num_speculative_tokens": 3}`) and SGLang (`--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR`) load: a Llama-style config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size`,
`target_hidden_size`, the RoPE base the head was trained with and `tie_word_embeddings: false`
(a tied head is silently replaced by the target's embedding in SGLang); weights without a
`model.` prefix: fc, midlayer.*, norm, lm_head, d2t (int64 offsets), t2d (bool) and, unless
`--no-embed-tokens`, the target's embed_tokens. The aux layer ids are not written: engines
use their default (2, L // 2, L - 3), so only heads trained on those layers are exported.
`from_eagle3` reads such a directory back into specstop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig, default_aux_layers
from decoding.models import DTYPES, ModelError
from decoding.target_layout import target_layout

from .eagle3_layout import check_exportable

ARCH = "LlamaForCausalLMEagle3"


def eagle3_config(cfg: FeatureDraftConfig, dtype: str, target_config=None) -> dict:
    out = {
        "architectures": [ARCH], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype, "use_cache": True,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_config is not None and getattr(target_config, key, None) is not None:
            out[key] = getattr(target_config, key)
    return out


def to_eagle3(draft: FeatureDraft, out, dtype: str = "bfloat16", target_config=None,
              embed_tokens: bool = True) -> Path:
    """Write `draft` in the EAGLE-3 serving layout (atomic)."""
    from safetensors.torch import save_file

    from decoding.drafts.io import atomic_dir

    cfg = draft.config
    if cfg.aux_layers != default_aux_layers(cfg.target_num_layers):
        raise ModelError(f"this head reads target layers {list(cfg.aux_layers)}; serving engines use "
                         f"{list(default_aux_layers(cfg.target_num_layers))} (the EAGLE-3 default): retrain on those")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    check_exportable(draft)  # a scaled embedding (Gemma) only where the engines' head matches
    state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in draft.state_dict().items()}
    if embed_tokens:
        if draft.embed_weight is None:
            raise ModelError("embed_tokens asked for but the head has no target embeddings attached")
        state["embed_tokens.weight"] = draft.embed_weight.to(DTYPES[dtype]).cpu().contiguous()

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(eagle3_config(cfg, dtype, target_config), indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return atomic_dir(Path(out), write)


def from_eagle3(path, target, dtype: str = "float32") -> FeatureDraft:
    """Read an EAGLE-3 serving directory back into a FeatureDraft for `target`."""
    from safetensors.torch import load_file

    p = Path(path)
    try:
        c = json.loads((p / "config.json").read_text())
        state = load_file(str(p / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read an EAGLE-3 draft from {p}: {str(e).splitlines()[0]}") from e
    if ARCH not in c.get("architectures", []):
        raise ModelError(f"{p}: not an EAGLE-3 draft (architectures {c.get('architectures')})")
    tc = target.config
    if c.get("target_hidden_size", c["hidden_size"]) != tc.hidden_size or c["vocab_size"] != tc.vocab_size:
        raise ModelError(f"{p}: made for a target with hidden {c.get('target_hidden_size')} and vocab "
                         f"{c['vocab_size']}, not {tc.hidden_size} / {tc.vocab_size}")
    n = tc.num_hidden_layers
    cfg = FeatureDraftConfig(
        hidden_size=c["hidden_size"], target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
        target_num_layers=n, aux_layers=default_aux_layers(n), num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        draft_vocab_size=c.get("draft_vocab_size") or c["vocab_size"],
        rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_norm_eps=c["rms_norm_eps"], max_position_embeddings=c["max_position_embeddings"],
        embed_scale=target_layout(target).embed_scale)  # not in the format: the target's own
    state.pop("embed_tokens.weight", None)  # the target's own embeddings are used
    draft = FeatureDraft(cfg)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{p}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    draft = draft.to(DTYPES[dtype]).eval()
    draft.attach_embeddings(target.get_input_embeddings().weight)
    return draft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=["eagle3"], help="serving layout to write")
    ap.add_argument("--draft", required=True, help="specstop feature-draft checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (replaced atomically)")
    ap.add_argument("--target", default=None, help="the head's target (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight dtype")
    ap.add_argument("--no-embed-tokens", action="store_true",
                    help="leave the target's token embeddings out (engines then share the target's)")
    args = ap.parse_args(argv)
    from decoding import models
    from decoding.drafts.io import draft_kind, load_feature_draft

    try:
        if draft_kind(models.resolve_model_dir(args.draft)) != "eagle3":
            raise ModelError(f"{args.draft} is not a feature draft: only EAGLE-3 heads export to eagle3")
        target = models.load_model(args.target, "float32")
        draft = load_feature_draft(args.draft, target)
        out = to_eagle3(draft, args.out, args.dtype, target.config, not args.no_embed_tokens)
    except (ModelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({ARCH}, draft vocab {draft.config.draft_vocab_size}, {args.dtype})")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.exit(main())
