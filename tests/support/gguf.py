"""A tiny model written as a quantized Llama GGUF, as llama.cpp's converter lays it out (the
quantized-blocks and GGUF-export tests)."""

import numpy as np
import torch

from decoding.forward import kquants
from decoding.forward.gguf_reader import LAYER_NAMES


def _permute(rows, heads):  # llama.cpp's converter, on rows of blocks
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(model, path, kind="Q4_1", arch="llama"):
    """The model's linears as a GGUF of `kind` blocks (a K-quant: Q5_0 off whole super-blocks, as
    llama.cpp's quantizer does), q / k rows permuted as llama.cpp's converter does for llama only."""
    import gguf

    names = {v: k for k, v in LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), arch)
    cfg = model.config
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear:
            continue
        this = kquants.fitting(kind, mod.weight.shape[1])
        blocks = kquants.quantize_raw(mod.weight.detach().numpy(), this)
        if name == "lm_head":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.I.self_attn.q_proj
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:])]}.weight"
        if arch == "llama" and gname.endswith("attn_q.weight"):
            blocks = _permute(blocks, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            blocks = _permute(blocks, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(blocks), raw_dtype=gguf.GGMLQuantizationType[this])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
