"""`python -m training.export --format eagle3|speculators`: the serving layouts (names, shapes,
dtypes, config keys), round trips back into specstop with identical logits (also a full
vocabulary, other aux layers, official EAGLE-3 and speculators checkpoints) and the refusals
of heads that would load mis-wired. (vLLM itself loads them in `make serve-check`.)"""

import copy
import json

import pytest
import torch
from safetensors import safe_open

from support.models import tiny_llama
from decoding.drafts.feature import default_aux_layers
from decoding.drafts.io import save_feature_draft
from decoding.models import ModelError, load_model
from support.head import tiny_feature_draft
from training.export.formats import from_eagle3, main, to_eagle3

LAYERS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    tiny_llama(0, vocab=40, layers=LAYERS, hidden=32).save_pretrained(root / "target")
    target = load_model(root / "target")
    head = tiny_feature_draft(target, draft_vocab=24, aux=default_aux_layers(LAYERS))
    save_feature_draft(head, root / "head", target)
    return root, target, head


def test_cli_writes_the_serving_layout(saved):
    root, target, head = saved
    assert main(["--format", "eagle3", "--draft", str(root / "head"), "--target", str(root / "target"),
                 "--out", str(root / "out"), "--with-embeddings"]) == 0
    cfg = json.loads((root / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (24, 32, 40)
    assert cfg["rope_theta"] == head.config.rope_theta and cfg["torch_dtype"] == "bfloat16"
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # engines interpret explicit ids differently
    H, kv = 32, 2 * 8
    want = {
        "fc.weight": ([H, 3 * H], torch.bfloat16), "norm.weight": ([H], torch.bfloat16),
        "lm_head.weight": ([24, H], torch.bfloat16), "d2t": ([24], torch.int64), "t2d": ([40], torch.bool),
        "embed_tokens.weight": ([40, H], torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": ([H, 2 * H], torch.bfloat16),
        "midlayer.self_attn.k_proj.weight": ([kv, 2 * H], torch.bfloat16),
        "midlayer.self_attn.v_proj.weight": ([kv, 2 * H], torch.bfloat16),
        "midlayer.self_attn.o_proj.weight": ([H, H], torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": ([64, H], torch.bfloat16),
        "midlayer.mlp.up_proj.weight": ([64, H], torch.bfloat16),
        "midlayer.mlp.down_proj.weight": ([H, 64], torch.bfloat16),
        "midlayer.hidden_norm.weight": ([H], torch.bfloat16),
        "midlayer.input_layernorm.weight": ([H], torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": ([H], torch.bfloat16),
    }
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        got = {k: (list(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}
        assert torch.equal(f.get_tensor("d2t"), head.d2t) and torch.equal(f.get_tensor("t2d"), head.t2d)
    assert got == {k: tuple(v) for k, v in want.items()}


def test_round_trip_gives_identical_logits(saved, tmp_path):
    _, target, head = saved
    out = to_eagle3(head, tmp_path / "fp32", "float32", target.config)  # no embeddings: the target's
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
    back = from_eagle3(out, target)
    assert back.config.aux_layers == head.config.aux_layers and back.config.rope_theta == head.config.rope_theta
    ids, aux = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, 96)
    with torch.no_grad():
        for (a, ha), (b, hb) in zip(head.unroll(ids, aux, 3), back.unroll(ids, aux, 3)):
            assert torch.equal(a, b) and torch.equal(ha, hb)
    bf = from_eagle3(to_eagle3(head, tmp_path / "bf16", "bfloat16", target.config), target, "bfloat16")
    ref = copy.deepcopy(head).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(bf.unroll(ids, aux, 2)[1][0], ref.unroll(ids, aux, 2)[1][0])


def test_refusals(saved, tmp_path, capsys):
    root, target, _ = saved
    assert main(["--format", "eagle3", "--draft", str(root / "target"), "--target", str(root / "target"),
                 "--out", str(tmp_path / "y")]) == 2
    assert "not a feature draft" in capsys.readouterr().err and not (tmp_path / "y").exists()
    with pytest.raises(ModelError, match="not an EAGLE-3 draft"):
        from_eagle3(root / "target", target)


def test_saved_head_is_readable_by_others(saved):
    root, _, _ = saved  # mkdtemp's 0700 must not leak into a shared checkpoint
    assert (root / "head").stat().st_mode & 0o777 == 0o755
    assert {f.stat().st_mode & 0o777 for f in (root / "head").iterdir()} == {0o644}
