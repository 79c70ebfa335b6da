"""A GGUF's quantized linears as QuantWeights (decoding.forward.quant), by transformers parameter
name: read from the file (read_gguf, q / k rows put back in the model's order), and kept once as
safetensors beside the converted target so a later load skips the parse (load_blocks, kept_blocks).
decoding.forward.gguf attaches them to a loaded target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from decoding.forward import kquants
from decoding.forward.quant import KINDS, QuantWeight

# GGUF tensor names of a Llama-family layer -> the transformers module they belong to
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q / k rows per head; undo it
    (as transformers' GGUF loader does), on whole rows of blocks."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def load_blocks(path: str | os.PathLike, config, cache_dir: Path | None = None) -> dict[str, QuantWeight]:
    """read_gguf, kept once as safetensors in `cache_dir` (the target's converted directory):
    parsing a GGUF (its 49k-token vocabulary) took 2.6 s a load; the kept blocks load in ~0.1 s.
    The file records the GGUF's size and time: another file is read anew (atomic write)."""
    st = Path(path).stat()
    return kept_blocks(lambda: read_gguf(path, config), f"{st.st_size}:{st.st_mtime_ns}", cache_dir)


READER = 2
"""What read_gguf keeps (2: + Q5_0 / Q4_K / Q6_K re-laid): a kept file of another version is read anew."""


def blocks_file(target_dir: Path) -> Path:
    """Where a converted target's blocks are kept: BESIDE its directory, never inside (an engine
    pointed at the directory loads every *.safetensors in it). A file kept inside by an older
    version moves out."""
    target_dir = Path(target_dir)
    out = target_dir.parent / f"{target_dir.name}.gguf_blocks.safetensors"
    old = target_dir / "gguf_blocks.safetensors"
    if old.is_file() and not out.exists():
        os.replace(old, out)
    return out


def kept_stamp(cache_dir: Path) -> str | None:
    """The source stamp of the blocks kept for `cache_dir` by this reader, None when none are."""
    from safetensors import safe_open

    kept = blocks_file(cache_dir)
    try:
        with safe_open(str(kept), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # absent, unreadable (safetensors raises its own error type)
        return None
    return meta.get("source") if meta.get("reader") == str(READER) else None


def kept_blocks(read, stamp: str, cache_dir: Path | None) -> dict[str, QuantWeight]:
    """`read()`'s blocks, kept in `cache_dir` under `stamp` (what identifies their source): a kept
    file of another stamp, unreadable or absent is read anew (atomic write)."""
    from safetensors.torch import load_file, save_file

    kept = blocks_file(cache_dir) if cache_dir is not None else None
    if kept is not None and kept.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(kept), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("source") == stamp and meta.get("reader") == str(READER):
                kinds = json.loads(meta["kinds"])
                return {n: QuantWeight(t, kinds[n][0], kinds[n][1]) for n, t in load_file(str(kept)).items()}
        except Exception:  # unreadable, corrupt (safetensors' own error type) or another version: read the GGUF again
            pass
    out = read()
    if kept is not None:
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
        try:
            save_file({n: w.w for n, w in out.items()}, str(tmp), metadata={
                "source": stamp, "reader": str(READER), "kinds": json.dumps({n: [w.kind, w.k] for n, w in out.items()})})
            os.replace(tmp, kept)
        except OSError:  # a read-only cache: read the GGUF each time
            tmp.unlink(missing_ok=True)
    return out


def read_gguf(path: str | os.PathLike, config) -> dict[str, QuantWeight]:
    """The quantized linears of a Llama-family (or Gemma 3) GGUF, by transformers parameter name
    (weights of an unsupported block type are left out: they stay dequantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else "llama"
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in KINDS and kind not in kquants.RELAID or len(t.shape) != 2:
            continue
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        else:
            continue
        k, rows, kid = int(t.shape[0]), np.asarray(t.data), KINDS.get(kind)
        if kind in kquants.RELAID:
            if kind != "Q5_0" and k % kquants.SUPER:
                continue
            rows, kid = kquants.relay(rows, kind, k)
        if arch == "llama" and parts[-2:-1] == ["attn_q"]:  # only llama's converter permutes them
            rows = _unpermute_rows(rows, heads)
        elif arch == "llama" and parts[-2:-1] == ["attn_k"]:
            rows = _unpermute_rows(rows, kv)
        out[name] = QuantWeight(torch.from_numpy(np.array(rows, copy=True)), kid, k)  # off the mmap
    return out
