"""Write a specstop feature head as a GGUF file llama.cpp serves as an EAGLE-3 draft:

    llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3

The PyPI `gguf` package (0.19) has no EAGLE3 architecture, so the arch name, keys and tensor
names below are spelled by hand after llama.cpp's loader (src/models/eagle3.cpp,
src/llama-arch.cpp) and its converter (conversion/llama.py):

- arch `eagle3`, one block; `eagle3.target_layers` (int32 x 3) are the target layers whose
  INPUT is captured (llama.cpp's llama_set_embeddings_layer_inp: specstop's pre-hooks, so the
  head's aux_layers go in unchanged); `eagle3.target_hidden_size`; norm_before_residual /
  norm_before_fc false (our wiring).
- q/k rows are permuted from Hugging Face's half-split RoPE to ggml's adjacent pairs (the
  arch uses LLAMA_ROPE_TYPE_NORM, as the converter's undo_permute assumes).
- `d2t` holds ABSOLUTE target ids (int64): llama.cpp scatters draft logits with it, where
  specstop / vLLM store offsets. `t2d` is not read by llama.cpp and is left out.
- no token_embd: llama.cpp embeds draft tokens with the target's own table (ctx_other),
  the table specstop's head was trained with; the own lm_head over the draft vocabulary is kept.
- the vocabulary: llama.cpp loads a tokenizer for every model and refuses a draft whose
  vocabulary differs from the target's, so the target GGUF's `tokenizer.*` keys are copied.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.models import ModelError

ARCH = "eagle3"
GGUF_DTYPES = {"float32": (np.float32, 0), "float16": (np.float16, 1)}  # numpy type, general.file_type
# specstop state-dict name -> llama.cpp tensor name (the single layer is blk.0)
NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def read_head(path) -> FeatureDraft:
    """A saved specstop head, without loading its target (the GGUF holds no embeddings)."""
    from safetensors.torch import load_file

    from decoding.drafts.io import KIND, MARKER, draft_kind

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"draft directory not found: {p}")
    if draft_kind(p) != KIND:
        raise ModelError(f"{p} is not a feature draft ({MARKER} names no eagle3 head): only EAGLE-3 "
                         "heads export to gguf")
    try:
        raw = json.loads((p / "config.json").read_text())
        raw.pop("model_type", None)
        draft = FeatureDraft(FeatureDraftConfig.from_dict(raw))
        missing, unexpected = draft.load_state_dict(load_file(str(p / "model.safetensors")), strict=False)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"cannot read feature draft {p}: {str(e).splitlines()[0]}") from e
    if missing or unexpected:
        raise ModelError(f"feature draft {p}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    draft.config._name_or_path = str(p)  # names the file's general.name, as load_feature_draft does
    return draft.eval()


def rope_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q/k from HF's RoPE (dims i and i + d/2 rotate together) to ggml's NORM RoPE
    (dims 2i and 2i + 1): row h*d + 2i + j takes row h*d + j*d/2 + i."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def target_meta(target_gguf) -> tuple[dict, list]:
    """The target GGUF's shape keys (arch prefix dropped) and its tokenizer.* fields."""
    from gguf import GGUFReader, GGUFValueType

    p = Path(target_gguf)
    try:
        r = GGUFReader(p)
    except (OSError, ValueError) as e:  # ValueError: not a GGUF (bad magic, truncated)
        raise ModelError(f"cannot read target GGUF {p}: {str(e).splitlines()[0]}") from e
    arch = r.fields["general.architecture"].contents() if "general.architecture" in r.fields else ""
    shape = {k.removeprefix(arch + "."): f.contents() for k, f in r.fields.items()
             if k.startswith(arch + ".") and f.types and f.types[0] != GGUFValueType.ARRAY}
    tok = [f for k, f in r.fields.items() if k.startswith("tokenizer.")]
    if "tokenizer.ggml.tokens" not in r.fields:
        raise ModelError(f"target GGUF {p} has no tokenizer (tokenizer.ggml.tokens): llama.cpp needs "
                         "the target's vocabulary in the draft")
    shape["n_vocab"] = len(r.fields["tokenizer.ggml.tokens"].data)
    return shape, tok


def check_target(c: FeatureDraftConfig, shape: dict, target_gguf) -> None:
    """The head must fit the target llama.cpp pairs it with (features, embeddings, vocabulary)."""
    have = {"vocabulary": shape.get("n_vocab"), "hidden size": shape.get("embedding_length"),
            "layers": shape.get("block_count")}
    want = {"vocabulary": c.vocab_size, "hidden size": c.target_hidden_size, "layers": c.target_num_layers}
    bad = [f"{k} {want[k]} vs {have[k]}" for k in want if have[k] != want[k]]
    if c.hidden_size != c.target_hidden_size:  # llama.cpp embeds draft tokens with the target's table
        bad.append(f"head width {c.hidden_size} vs target embeddings {c.target_hidden_size}")
    if bad:
        raise ModelError(f"this head does not fit the target GGUF {target_gguf} (head vs file: {'; '.join(bad)})")


def absolute_d2t(draft: FeatureDraft) -> np.ndarray | None:
    """Draft id -> target id (llama.cpp's d2t); None for the identity (no mapping written)."""
    c = draft.config
    ids = (torch.arange(c.draft_vocab_size) + draft.d2t.cpu().long()).numpy().astype(np.int64)
    if c.draft_vocab_size == c.vocab_size and (ids == np.arange(c.vocab_size)).all():
        return None
    if ids.min() < 0 or ids.max() >= c.vocab_size or np.unique(ids).size != ids.size:
        raise ModelError("the head's d2t maps outside the target vocabulary or twice to one id")
    return ids


def export_gguf(head_dir_or_draft, out_path, target_gguf, dtype: str = "float32") -> Path:
    """Write the head (a FeatureDraft or a saved head's directory) as an EAGLE-3 GGUF draft for
    the target GGUF `target_gguf`; atomic (temp file + rename). ModelError for bad input."""
    from gguf import GGUFValueType, GGUFWriter

    from training.export.eagle3_layout import check_exportable

    if dtype not in GGUF_DTYPES:
        raise ModelError(f"gguf export writes {' or '.join(GGUF_DTYPES)} weights, not {dtype!r}")
    draft = head_dir_or_draft if isinstance(head_dir_or_draft, FeatureDraft) else read_head(head_dir_or_draft)
    c = draft.config
    if len(set(c.aux_layers)) != 3 or max(c.aux_layers) >= c.target_num_layers:
        raise ModelError(f"aux layers {list(c.aux_layers)} cannot be served (3 distinct target layers needed)")
    check_exportable(draft)  # a scaled (Gemma) embedding: llama.cpp embeds unscaled too
    shape, tok_fields = target_meta(target_gguf)
    check_target(c, shape, target_gguf)
    np_type, file_type = GGUF_DTYPES[dtype]

    state = {k: v.detach().float().cpu() for k, v in draft.state_dict().items() if k in NAMES}
    state["midlayer.self_attn.q_proj.weight"] = rope_pairs(state["midlayer.self_attn.q_proj.weight"],
                                                           c.num_attention_heads)
    state["midlayer.self_attn.k_proj.weight"] = rope_pairs(state["midlayer.self_attn.k_proj.weight"],
                                                           c.num_key_value_heads)
    d2t = absolute_d2t(draft)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp-")
    os.close(fd)
    try:
        w = GGUFWriter(tmp, ARCH)
        w.add_type("model")
        w.add_name(f"specstop EAGLE-3 head ({Path(getattr(c, '_name_or_path', '') or 'draft').name})")
        w.add_uint32("general.file_type", file_type)
        u32 = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
               "block_count": 1, "feed_forward_length": c.intermediate_size,
               "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
               "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
               "rope.dimension_count": c.head_dim, "vocab_size": c.vocab_size,
               "target_hidden_size": c.target_hidden_size}
        for key, val in u32.items():
            w.add_uint32(f"{ARCH}.{key}", int(val))
        w.add_float32(f"{ARCH}.rope.freq_base", float(c.rope_theta))  # the head's own RoPE base
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
        # the C++ side reads the layers into int32s: an explicit sub-type (python ints would
        # also pack as int32 today, but the loader's type check is strict)
        w.add_key_value(f"{ARCH}.target_layers", [int(i) for i in c.aux_layers],
                        GGUFValueType.ARRAY, GGUFValueType.INT32)
        w.add_bool(f"{ARCH}.norm_before_residual", False)
        w.add_bool(f"{ARCH}.norm_before_fc", False)
        for f in tok_fields:  # the target's vocabulary, values and types as they are
            if f.types[0] == GGUFValueType.ARRAY:
                w.add_key_value(f.name, f.contents(), GGUFValueType.ARRAY, f.types[-1])
            else:
                w.add_key_value(f.name, f.contents(), f.types[0])
        for name, t in state.items():
            # norms stay float32 (as llama.cpp's converter keeps 1-D tensors): ggml multiplies f32 by them
            w.add_tensor(NAMES[name], t.numpy().astype(np_type if t.dim() == 2 else np.float32))
        if d2t is not None:
            w.add_tensor("d2t", d2t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)  # mkstemp's 0600 must not leak into an artifact others serve
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
