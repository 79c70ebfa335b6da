"""The exporter and importer against what the engines' loaders do: full vocabulary
without d2t / t2d, other aux layers written in vLLM's convention, official EAGLE-3 and
speculators checkpoints read, mis-wiring flags refused in one line, the trained window."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from support.models import tiny_llama
from decoding.drafts.feature import default_aux_layers
from decoding.drafts.io import save_feature_draft
from decoding.models import ModelError, load_model
from support.head import tiny_feature_draft
from training.export.formats import main, to_eagle3
from training.export.eagle3_import import from_eagle3

LAYERS, VOCAB = 8, 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    tiny_llama(0, vocab=VOCAB, layers=LAYERS, hidden=32).save_pretrained(root / "target")
    return root, load_model(root / "target")


def same_unroll(a, b, steps=3):
    ids, aux = torch.randint(0, VOCAB, (2, 6)), torch.randn(2, 6, 96)
    with torch.no_grad():
        for (la, ha), (lb, hb) in zip(a.unroll(ids, aux, steps), b.unroll(ids, aux, steps)):
            assert torch.equal(la, lb) and torch.equal(ha, hb)


def keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_full_vocabulary_head_has_no_d2t_and_round_trips(target, tmp_path):
    _, t = target
    head = tiny_feature_draft(t, draft_vocab=VOCAB, aux=default_aux_layers(LAYERS))
    out = to_eagle3(head, tmp_path / "full", "float32", t.config)
    assert not {"d2t", "t2d"} & keys(out)  # vLLM refuses a d2t it has no buffer for
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == VOCAB
    back = from_eagle3(out, t)
    assert torch.equal(back.used_ids, torch.arange(VOCAB)) and bool(back.t2d.all())
    same_unroll(head, back)
    reduced = to_eagle3(tiny_feature_draft(t, draft_vocab=24, aux=default_aux_layers(LAYERS)),
                        tmp_path / "red", "float32", t.config)
    assert {"d2t", "t2d"} <= keys(reduced)
    state = load_file(str(reduced / "model.safetensors"))
    del state["d2t"], state["t2d"]
    from safetensors.torch import save_file
    save_file(state, str(reduced / "model.safetensors"))
    with pytest.raises(ModelError, match="no d2t / t2d for a reduced draft vocabulary"):
        from_eagle3(reduced, t)


def test_other_aux_layers_are_written_and_honoured(target, tmp_path):
    _, t = target
    head = tiny_feature_draft(t, aux=(1, 3, 6))
    out = to_eagle3(head, tmp_path / "aux", "float32", t.config)
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    back = from_eagle3(out, t)
    assert back.config.aux_layers == (1, 3, 6)
    same_unroll(head, back)
    default = to_eagle3(tiny_feature_draft(t, aux=default_aux_layers(LAYERS)), tmp_path / "d", "float32")
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((default / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}  # vLLM reads it there too
    (out / "config.json").write_text(json.dumps(cfg))
    assert from_eagle3(out, t).config.aux_layers == (0, 2, 5)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, LAYERS]}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="must be 3 layers of the target's 8"):
        from_eagle3(out, t)
    with pytest.raises(ModelError, match="repeat a layer"):  # vLLM would feed fc two states
        to_eagle3(tiny_feature_draft(t, aux=(2, 3, 3)), tmp_path / "dup")


@pytest.mark.parametrize("key,value", [
    ("norm_before_residual", True), ("norm_before_fc", True), ("fc_norm", True), ("norm_output", True),
    ("tie_word_embeddings", True), ("attention_bias", True), ("num_hidden_layers", 2),
    ("logit_scale", 2.0), ("hidden_act", "gelu"), ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("eagle_config", {"use_aux_hidden_state": False}), ("eagle_config", {"norm_before_fc": True}),
])
def test_mis_wiring_flags_are_refused_in_one_line(target, tmp_path, key, value):
    _, t = target
    out = to_eagle3(tiny_feature_draft(t, aux=default_aux_layers(LAYERS)), tmp_path / "h", "float32")
    cfg = json.loads((out / "config.json").read_text()) | {key: value}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        from_eagle3(out, t)
    assert "\n" not in str(e.value) and str(out) in str(e.value)


def test_official_eagle3_checkpoint_loads(target, tmp_path):
    """SafeAILab's layout: architecture LlamaForCausalLM, weights in pytorch_model.bin (read
    with weights_only), embed_tokens inside, no target_hidden_size."""
    _, t = target
    head = tiny_feature_draft(t, aux=default_aux_layers(LAYERS))
    out = to_eagle3(head, tmp_path / "ours", "float32", t.config, embed_tokens=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    for k in ("target_hidden_size", "norm_before_residual", "head_dim"):
        del cfg[k]
    off = tmp_path / "official"
    off.mkdir()
    (off / "config.json").write_text(json.dumps(cfg))
    torch.save(load_file(str(out / "model.safetensors")), off / "pytorch_model.bin")
    same_unroll(head, from_eagle3(off, t))
    cfg.pop("draft_vocab_size")  # a plain Llama is not a head
    (off / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="not an EAGLE-3 draft"):
        from_eagle3(off, t)


def test_speculators_layout_for_vllm_serve(target, tmp_path, capsys):
    root, t = target
    head = tiny_feature_draft(t, aux=(1, 3, 6))
    save_feature_draft(head, root / "head-aux", t, {"data": {"window": 48}})
    assert main(["--format", "speculators", "--draft", str(root / "head-aux"), "--target", str(root / "target"),
                 "--out", str(tmp_path / "spec"), "--dtype", "float32", "--speculative-tokens", "4"]) == 0
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
    sc = cfg["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"]["name_or_path"] == str((root / "target").resolve())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6] and cfg["trained_window"] == 48
    names = keys(tmp_path / "spec")
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    same_unroll(head, from_eagle3(tmp_path / "spec", t))
    del cfg["norm_before_residual"]  # speculators' default is true: a head built otherwise
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="norm_before_residual = True"):
        from_eagle3(tmp_path / "spec", t)


def test_trained_window_is_written_not_promised(target, tmp_path, capsys):
    root, t = target
    head = tiny_feature_draft(t, aux=default_aux_layers(LAYERS))
    save_feature_draft(head, root / "head-w", t, {"data": {"window": 48}})
    args = ["--format", "eagle3", "--draft", str(root / "head-w"), "--target", str(root / "target")]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    # the positions the head's RoPE serves stay the target's (SGLang caps the context at it)
    assert cfg["trained_window"] == 48 and cfg["max_position_embeddings"] == t.config.max_position_embeddings
    assert main([*args, "--out", str(tmp_path / "b"), "--trained-window", "32"]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["trained_window"] == 32
    assert main([*args, "--out", str(tmp_path / "c"), "--trained-window", "100000"]) == 2
    assert "trained window 100000" in capsys.readouterr().err and not (tmp_path / "c").exists()
    save_feature_draft(head, root / "head-nw", t)
    assert main(["--format", "eagle3", "--draft", str(root / "head-nw"), "--target", str(root / "target"),
                 "--out", str(tmp_path / "d")]) == 0
    assert "records no trained window" in capsys.readouterr().err
    assert "trained_window" not in json.loads((tmp_path / "d" / "config.json").read_text())
