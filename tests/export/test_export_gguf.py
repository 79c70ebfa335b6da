"""`python -m training.export --format gguf`: the EAGLE-3 GGUF llama.cpp loads (arch, the keys
its loader requires, tensor names / ggml shapes, values), q/k rows permuted so that ggml's
RoPE gives the attention scores our head computes, and clean refusals. (llama-server itself
serves the shipped head in docs/serving.md's check; no llama.cpp here.)"""

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from support.models import tiny_llama
from decoding.drafts.feature import default_aux_layers
from decoding.drafts.io import save_feature_draft
from decoding.forward import quant
from decoding.models import ModelError, load_model
from support.head import tiny_feature_draft
from training.export.formats import main
from training.export.gguf_head import export_gguf

LAYERS, VOCAB, H = 8, 40, 32


def target_gguf(path, vocab=VOCAB, layers=LAYERS):
    """A stand-in target GGUF: only the keys the export reads (shapes, the tokenizer)."""
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", layers)
    w.add_uint32("llama.embedding_length", H)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    tiny_llama(0, vocab=VOCAB, layers=LAYERS, hidden=H).save_pretrained(root / "target")
    target = load_model(root / "target")
    head = tiny_feature_draft(target, draft_vocab=24, aux=default_aux_layers(LAYERS))
    save_feature_draft(head, root / "head", target)
    return root, head, target_gguf(root / "target.gguf")


def fields(r):
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_cli_writes_what_llama_cpp_loads(saved, tmp_path):
    root, head, tgguf = saved
    out = tmp_path / "head.gguf"
    assert main(["--format", "gguf", "--draft", str(root / "head"), "--target", str(root / "target"),
                 "--target-gguf", str(tgguf), "--out", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["head.gguf"]  # no temp file left
    assert out.stat().st_mode & 0o777 == 0o644
    r = GGUFReader(out)
    kv, c = fields(r), head.config
    assert kv["general.architecture"] == "eagle3" and kv["general.file_type"] == 0
    want = {"block_count": 1, "embedding_length": H, "context_length": c.max_position_embeddings,
            "feed_forward_length": 2 * H, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 8, "attention.value_length": 8, "rope.dimension_count": 8,
            "vocab_size": VOCAB, "target_hidden_size": H, "target_layers": [2, 4, 5],
            "norm_before_residual": False, "norm_before_fc": False}
    assert {k: kv[f"eagle3.{k}"] for k in want} == want
    assert r.fields["eagle3.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert kv["eagle3.rope.freq_base"] == pytest.approx(c.rope_theta)
    assert kv["eagle3.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    # the target's vocabulary, copied with its types
    assert kv["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(VOCAB)] and kv["tokenizer.ggml.model"] == "gpt2"
    assert r.fields["tokenizer.ggml.bos_token_id"].types == [GGUFValueType.UINT32]

    t = {x.name: x for x in r.tensors}
    kvd = 2 * 8
    shapes = {  # ggml order (ne: innermost first), as llama.cpp's eagle3 loader asks for them
        "fc.weight": [3 * H, H], "output_norm.weight": [H], "output.weight": [H, 24], "d2t": [24],
        "blk.0.attn_norm.weight": [H], "blk.0.attn_norm_2.weight": [H], "blk.0.ffn_norm.weight": [H],
        "blk.0.attn_q.weight": [2 * H, H], "blk.0.attn_k.weight": [2 * H, kvd], "blk.0.attn_v.weight": [2 * H, kvd],
        "blk.0.attn_output.weight": [H, H], "blk.0.ffn_gate.weight": [H, 2 * H],
        "blk.0.ffn_up.weight": [H, 2 * H], "blk.0.ffn_down.weight": [2 * H, H],
    }
    assert {n: [int(s) for s in x.shape] for n, x in t.items()} == shapes
    assert t["d2t"].tensor_type == GGMLQuantizationType.I64
    assert {x.tensor_type for n, x in t.items() if n != "d2t"} == {GGMLQuantizationType.F32}
    sd = head.state_dict()
    for ours, theirs in [("fc.weight", "fc.weight"), ("lm_head.weight", "output.weight"),
                         ("midlayer.hidden_norm.weight", "blk.0.attn_norm_2.weight"),
                         ("midlayer.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                         ("midlayer.self_attn.v_proj.weight", "blk.0.attn_v.weight")]:
        assert np.array_equal(np.asarray(t[theirs].data), sd[ours].numpy()), theirs
    # llama.cpp scatters draft logits to ABSOLUTE target ids
    assert np.array_equal(np.asarray(t["d2t"].data), (torch.arange(24) + head.d2t).numpy())


def ggml_rope_norm(x, pos, base):
    """ggml's LLAMA_ROPE_TYPE_NORM on [heads, d]: dims (2i, 2i + 1) rotate by pos * base^(-2i/d)."""
    d = x.shape[-1]
    ang = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
    return out


def test_permuted_qk_give_our_attention_scores(saved, tmp_path):
    root, head, tgguf = saved
    t = {x.name: np.asarray(x.data, dtype=np.float64)
         for x in GGUFReader(export_gguf(head, tmp_path / "h.gguf", tgguf)).tensors}
    c, attn = head.config, copy.deepcopy(head.midlayer.self_attn).double()
    x = torch.randn(1, 2, 2 * H, dtype=torch.float64)
    with torch.no_grad():
        q, k, _ = attn.qkv(x, torch.tensor([[3, 11]]))  # ours: HF's half-split RoPE
    ours = torch.einsum("hd,hd->h", q[0, :, 1], attn.expand(k)[0, :, 0]).numpy()
    xs = x[0].numpy()
    qg = ggml_rope_norm((t["blk.0.attn_q.weight"] @ xs[1]).reshape(4, 8), 11, c.rope_theta)
    kg = ggml_rope_norm((t["blk.0.attn_k.weight"] @ xs[0]).reshape(2, 8), 3, c.rope_theta)
    theirs = np.einsum("hd,hd->h", qg, np.repeat(kg, 2, axis=0))
    assert np.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_float16_and_from_a_directory(saved, tmp_path):
    root, head, tgguf = saved
    r = GGUFReader(export_gguf(root / "head", tmp_path / "h16.gguf", tgguf, "float16"))
    t = {x.name: x for x in r.tensors}
    assert fields(r)["general.file_type"] == 1
    assert t["fc.weight"].tensor_type == GGMLQuantizationType.F16
    assert t["output_norm.weight"].tensor_type == GGMLQuantizationType.F32  # norms stay f32
    assert np.allclose(np.asarray(t["fc.weight"].data, dtype=np.float32), head.fc.weight.detach().numpy(),
                       atol=1e-3)


def test_refusals(saved, tmp_path, capsys):
    root, head, tgguf = saved
    out = tmp_path / "x.gguf"
    assert main(["--format", "gguf", "--draft", str(tmp_path / "missing"), "--target", str(root / "target"),
                 "--target-gguf", str(tgguf), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not found" in err and len(err.strip().splitlines()) == 1
    assert main(["--format", "gguf", "--draft", str(root / "head"), "--target-gguf", str(tgguf),
                 "--dtype", "bfloat16", "--out", str(out)]) == 2
    assert "float32 or float16" in capsys.readouterr().err
    with pytest.raises(ModelError, match="does not fit the target GGUF"):  # another target's vocabulary
        export_gguf(head, out, target_gguf(tmp_path / "other.gguf", vocab=VOCAB + 1))
    assert main(["--format", "gguf", "--draft", str(root / "target"), "--target", str(root / "target"),
                 "--target-gguf", str(tgguf), "--out", str(out)]) == 2
    assert "not a feature draft" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.gguf"]  # nothing written, no temp left


@pytest.mark.skipif(not quant.available(), reason="needs the quantized kernel")
def test_f32_copy_of_a_quantized_gguf(tmp_path):
    """make llama-check's target: every tensor dequantized to float32, the metadata kept."""
    import gguf
    import numpy as np

    from support.models import tiny_llama
    from support.gguf import write_gguf
    from training.export.llama_check import write_f32_gguf

    src = tmp_path / "q.gguf"
    write_gguf(tiny_llama(0, vocab=32, hidden=32), src)
    out = write_f32_gguf(src, tmp_path / "f32.gguf")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    assert b.fields["general.architecture"].contents() == "llama" and b.fields["general.file_type"].contents() == 0
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type.name == "F32"
        assert np.array_equal(np.asarray(tb.data), gguf.quants.dequantize(ta.data, ta.tensor_type))
