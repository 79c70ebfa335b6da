"""A tiny model written as a quantized Llama GGUF, as llama.cpp's converter lays it out (the
quantized-blocks and GGUF-export tests)."""

import numpy as np
import torch

from decoding.forward import quant


def _permute(rows, heads):  # llama.cpp's converter, on rows of blocks
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(model, path, kind="Q4_1"):
    """The model's linears as a Llama GGUF of `kind` blocks, q / k rows permuted as llama.cpp does."""
    import gguf

    names = {v: k for k, v in quant.LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    cfg = model.config
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear:
            continue
        blocks = quant.quantize(mod.weight, kind).w.numpy()
        if name == "lm_head":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.I.self_attn.q_proj
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:])]}.weight"
        if gname.endswith("attn_q.weight"):
            blocks = _permute(blocks, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            blocks = _permute(blocks, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(blocks), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
