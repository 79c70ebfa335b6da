"""Export a specstop feature head for other serving engines.

    python -m training.export --format eagle3|speculators --draft DIR --out DIR [--target DIR]
        [--dtype bfloat16] [--with-embeddings] [--trained-window N] [--speculative-tokens 3]
    python -m training.export --format gguf --draft DIR --out HEAD.gguf [--target-gguf FILE]

`eagle3` writes the layout vLLM (`speculative_config={"method": "eagle3", "model": DIR,
"num_speculative_tokens": 3}`) and SGLang (`--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR`) load: a Llama-style config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size`,
`target_hidden_size`, the RoPE base the head was trained with, `norm_before_residual: false`
and `tie_word_embeddings: false` (a tied head is silently replaced by the target's embedding
in SGLang); weights without a `model.` prefix: fc, midlayer.*, norm, lm_head and, for a
reduced draft vocabulary only, d2t (int64 offsets) and t2d (bool): vLLM refuses a d2t when
the draft vocabulary is the target's. The target's embed_tokens only with --with-embeddings
(both engines share the target's own when it is left out: 56 MB less for SmolLM2).

`speculators` writes the layout `vllm serve DIR` reads alone: `speculators_config` (the
verifier = the target directory, the proposal's speculative tokens), the Llama fields in
`transformer_layer_config`, `norm_before_residual: false` explicit (that path defaults it to
true) and the layer named `layers.0.*`.

Aux layers: the default (2, L // 2, L - 3) is left implicit (the portable choice: SGLang reads
explicit ids shifted); other layers are written as `eagle_aux_hidden_state_layer_ids` in
vLLM's convention (the INPUT of layer i, as specstop's pre-hooks).

Positions: `max_position_embeddings` stays the target's (SGLang caps the served context at the
draft's value; vLLM 0.32 raises a smaller one to the target's max_model_len), and
`trained_window` records the longest row the head was trained on (prompt tail + completion:
384 for the shipped head). Beyond it acceptance is unmeasured, not guaranteed. Neither engine
reads `trained_window`. `training.export.eagle3_import.from_eagle3` reads every layout back.

`gguf` writes one file llama.cpp serves as an EAGLE-3 draft (`llama-server -m TARGET.gguf -md
HEAD.gguf --spec-type draft-eagle3`; training.export.gguf_head): float32 (default) or float16
weights, the vocabulary copied from the target GGUF (`--target-gguf`; default: `--target` when
it is a .gguf, else the embedded SmolLM2 file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig, default_aux_layers
from decoding.models import DTYPES, ModelError
from decoding.options import add_option

from training.export.eagle3_layout import check_exportable

from training.export.eagle3_import import ARCH, from_eagle3  # noqa: F401 (re-exported: the reader beside the writer)

FORMATS = ("eagle3", "speculators", "gguf")


def llama_fields(cfg: FeatureDraftConfig, dtype: str) -> dict:
    return {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype, "use_cache": True,
    }


def head_fields(cfg: FeatureDraftConfig, window: int | None) -> dict:
    """EAGLE-3 fields both layouts carry at the top level."""
    out = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
           "norm_before_residual": False}
    if cfg.aux_layers != default_aux_layers(cfg.target_num_layers):
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layers)
    if window is not None:
        out["trained_window"] = int(window)
    return out


def eagle3_config(cfg: FeatureDraftConfig, dtype: str, target_config=None, window: int | None = None) -> dict:
    out = {"architectures": [ARCH], **llama_fields(cfg, dtype), **head_fields(cfg, window)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_config is not None and getattr(target_config, key, None) is not None:
            out[key] = getattr(target_config, key)
    return out


def speculators_config(cfg: FeatureDraftConfig, dtype: str, verifier: str, tokens: int,
                       target_config=None, window: int | None = None) -> dict:
    archs = list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_fields(cfg, dtype), **head_fields(cfg, window),
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens)}],
            "verifier": {"name_or_path": str(verifier), "architectures": archs}},
    }


def export_state(draft: FeatureDraft, dtype: str, embed_tokens: bool, layer_prefix: str) -> dict:
    cfg = draft.config
    state = {}
    for k, v in draft.state_dict().items():
        if k in ("d2t", "t2d") and cfg.draft_vocab_size == cfg.vocab_size:
            continue  # full vocabulary: no mapping (vLLM has nowhere to put a d2t then)
        state[layer_prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k] = (
            v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
    if embed_tokens:
        if draft.embed_weight is None:
            raise ModelError("embeddings asked for but the head has no target embeddings attached")
        state["embed_tokens.weight"] = draft.embed_weight.to(DTYPES[dtype]).cpu().contiguous()
    return state


def to_eagle3(draft: FeatureDraft, out, dtype: str = "bfloat16", target_config=None,
              embed_tokens: bool = False, window: int | None = None, fmt: str = "eagle3",
              verifier: str | None = None, speculative_tokens: int = 3) -> Path:
    """Write `draft` in a serving layout (`fmt`: eagle3 | speculators); atomic."""
    from safetensors.torch import save_file

    from decoding.drafts.io import atomic_dir

    cfg = draft.config
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise ModelError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if len(set(cfg.aux_layers)) != 3:  # vLLM captures each layer once: fc would get too few
        raise ModelError(f"aux layers {list(cfg.aux_layers)} repeat a layer: engines cannot serve it")
    if window is not None and not 0 < window <= cfg.max_position_embeddings:
        raise ModelError(f"trained window {window} must be in 1..{cfg.max_position_embeddings}")
    if fmt == "speculators":
        if not verifier:
            raise ModelError("the speculators layout names its verifier: give the target directory")
        if not 1 <= speculative_tokens <= 16:
            raise ModelError(f"speculative tokens must be in 1..16 (got {speculative_tokens})")
        config = speculators_config(cfg, dtype, verifier, speculative_tokens, target_config, window)
    else:
        config = eagle3_config(cfg, dtype, target_config, window)
    check_exportable(draft)  # a scaled embedding (Gemma) only where the engines' head matches
    state = export_state(draft, dtype, embed_tokens, "layers.0." if fmt == "speculators" else "midlayer.")

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return atomic_dir(Path(out), write)


def trained_window(draft_dir: Path) -> int | None:
    """The longest training row a specstop head records (its marker's data.window)."""
    from decoding.drafts.io import MARKER

    try:
        return (json.loads((draft_dir / MARKER).read_text()).get("data") or {}).get("window")
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=FORMATS, help="serving layout to write")
    add_option(ap, "draft", required=True)
    add_option(ap, "out", required=True)
    add_option(ap, "target")
    add_option(ap, "dtype", only=tuple(DTYPES), unset="bfloat16; gguf: float32")
    ap.add_argument("--target-gguf", default=None,
                    help="gguf: the target GGUF served with the head, whose vocabulary the file copies "
                         "(default: --target when it is a .gguf, else the embedded SmolLM2)")
    ap.add_argument("--with-embeddings", action="store_true",
                    help="also write the target's token embeddings (engines share the target's otherwise)")
    ap.add_argument("--trained-window", type=int, default=None,
                    help="positions per training row, when the head's marker does not record it")
    ap.add_argument("--speculative-tokens", type=int, default=3, help="speculators: draft tokens per step")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.format == "gguf" else "bfloat16")
    from decoding import models
    from decoding.drafts.io import draft_kind, load_feature_draft

    try:
        if args.format == "gguf":  # the cheap refusals before the target loads
            from training.export.gguf_head import GGUF_DTYPES, export_gguf

            if args.with_embeddings:
                raise ModelError("gguf: llama.cpp embeds draft tokens with the target's own table; "
                                 "drop --with-embeddings")
            if args.dtype not in GGUF_DTYPES:
                raise ModelError(f"gguf export writes {' or '.join(GGUF_DTYPES)} weights, not {args.dtype}")
            tgguf = Path(args.target_gguf or (args.target if str(args.target).endswith(".gguf")
                                              else models.smollm2_gguf_path()))
            if not tgguf.is_file():
                raise ModelError(f"target GGUF not found: {tgguf}")
        ddir = models.resolve_model_dir(args.draft)
        if draft_kind(ddir) != "eagle3":
            raise ModelError(f"{args.draft} is not a feature draft: only EAGLE-3 heads export to {args.format}")
        target = models.load_model(args.target, "float32")
        draft = load_feature_draft(ddir, target)
        window = args.trained_window or trained_window(ddir)
        if args.format == "gguf":
            out = export_gguf(draft, args.out, tgguf, args.dtype)
        else:
            verifier = str(models.resolve_model_dir(args.target)) if args.target else str(models.default_target_dir())
            out = to_eagle3(draft, args.out, args.dtype, target.config, args.with_embeddings, window,
                            args.format, verifier, args.speculative_tokens)
    except (ModelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if window is None and args.format != "gguf":  # gguf has no field for it
        print("note: the head records no trained window (--trained-window N writes it)", file=sys.stderr)
    print(f"wrote {out} ({args.format}, draft vocab {draft.config.draft_vocab_size}, {args.dtype})")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.exit(main())
