"""read_gguf on a K-quant file written here: every tensor it re-lays dequantizes to exactly what
gguf's own dequantizer gives for the file's bytes, in the model's row order. The q / k rows are
stored as llama.cpp's converter stores them for llama (each head's two rotary halves interleaved)
by an index map written out below, not by the reader's reshape, so a wrong order or a wrong head
count in the reader cannot cancel against the writer."""

import numpy as np
import pytest
import torch

from decoding.forward import gguf_reader, kquants, quant
from support.kernels import require_quant
from support.models import tiny_llama

SHORT = {v: k for k, v in gguf_reader.LAYER_NAMES.items()}  # self_attn.q_proj -> attn_q


def llama_cpp_rows(n: int, heads: int) -> np.ndarray:
    """File row r of a head holds the model's row (r % 2) * half + r // 2 of that head."""
    dim = n // heads
    half = dim // 2
    return np.array([h * dim + (r % 2) * half + r // 2 for h in range(heads) for r in range(dim)])


def write(model, path, kind: str, arch: str) -> None:
    import gguf

    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    w = gguf.GGUFWriter(str(path), arch)
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear:
            continue
        this = kquants.fitting(kind, mod.weight.shape[1])  # Q5_0 off whole super-blocks
        blocks = kquants.quantize_raw(mod.weight.detach().numpy(), this)
        if name == "lm_head":
            gname = "output.weight"
        else:
            i, sub = name.split(".")[2], ".".join(name.split(".")[3:])
            gname = f"blk.{i}.{SHORT[sub]}.weight"
        short = gname.split(".")[-2]
        if arch == "llama" and short in heads:
            blocks = blocks[llama_cpp_rows(blocks.shape[0], heads[short])]
        w.add_tensor(gname, np.ascontiguousarray(blocks), raw_dtype=gguf.GGMLQuantizationType[this])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("hidden", [128, 256])  # 128: q / k / v / o / gate / up fall back to Q5_0
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_relaid_blocks_are_gguf_s_dequantization_in_model_order(kind, hidden, arch, tmp_path):
    import gguf

    require_quant()
    model = tiny_llama(0, vocab=32, hidden=hidden)  # 4 query heads over 2 kv heads
    cfg = model.config
    write(model, tmp_path / "m.gguf", kind, arch)
    blocks = gguf_reader.read_gguf(tmp_path / "m.gguf", cfg)
    params = dict(model.named_parameters())
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    seen = set()
    for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors:
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        short = t.name.split(".")[-2]
        if arch == "llama" and short in heads:
            unpermuted = np.empty_like(ref)
            unpermuted[llama_cpp_rows(ref.shape[0], heads[short])] = ref
            ref = unpermuted
        if t.name == "output.weight":
            name = "lm_head.weight"
        else:
            name = f"model.layers.{t.name.split('.')[1]}.{gguf_reader.LAYER_NAMES[short]}.weight"
        qw = blocks[name]
        want_kind = quant.KINDS[kind] if t.tensor_type.name == kind else quant.KINDS["Q8_0"]
        assert qw.kind == want_kind and (qw.n, qw.k) == ref.shape, name
        assert torch.equal(qw.dequant(), torch.from_numpy(ref)), name
        # and that is the model's matrix, row by row: quantization errs ~0.1 of a row's mean
        # magnitude at most here, a row in another row's place ~1.4
        dense = params[name].detach()
        err = (qw.dequant() - dense).abs().mean(1) / dense.abs().mean(1)
        assert err.max() < 0.3, name
        seen.add(name)
    assert seen == set(blocks) and len(seen) == 2 * 7 + 1
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors} == (
        {kind} if hidden == 256 else {kind, "Q5_0"})
