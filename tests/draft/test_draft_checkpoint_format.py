"""Drafts on disk are stock Hugging Face checkpoints; old ones convert; bad files fail in one line."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from decoding.drafts.format import DRAFT_META, OLD_MODEL_TYPE
from decoding.generate import main as generate_main
from decoding.models import MASKED_LOGIT, ModelError, PrunedHeadLlamaForCausalLM, load_model
from support.distill import EOS, V, tiny_tokenizer
from training.convert_draft import convert
from training.draft.distill import write_draft
from training.draft.module import DraftConfig, new_draft

HEAD = [1, EOS, *range(10, 50)]  # 42 of the 64 ids, BOS/EOS among them


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(target dir, draft dir, the draft as written (bf16)) for a tiny target/draft pair."""
    root = tmp_path_factory.mktemp("fmt")
    torch.manual_seed(0)
    tconf = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    target = LlamaForCausalLM(tconf).eval()
    with torch.no_grad():
        target.model.norm.weight.mul_(3)
    target.save_pretrained(root / "target")
    tiny_tokenizer(root / "target")
    torch.manual_seed(1)
    draft = new_draft(tconf, DraftConfig(layers=1, hidden=32, heads=2, intermediate=64,
                                         head_size=len(HEAD)))
    draft.set_head_ids(HEAD)
    out = write_draft(draft.eval(), root / "draft", {"kind": "specstop-draft", "note": "x"},
                      root / "target", "bfloat16")
    return root / "target", out, draft


def test_written_draft_is_a_stock_llama_checkpoint(made):
    _, d, _ = made
    conf = json.loads((d / "config.json").read_text())
    assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
    assert "head_size" not in conf and "lm_head.ids" not in load_file(d / "model.safetensors")
    meta = json.loads((d / DRAFT_META).read_text())
    assert meta["head_ids"] == HEAD and meta["schema_version"] == 2 and meta["note"] == "x"
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model) is LlamaForCausalLM and not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_stock_assisted_generation_with_the_draft(made):
    t, d, _ = made
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    x = torch.tensor([[1, 5, 9, 13, 17]])
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    plain = target.generate(x, **kw)
    assisted = target.generate(x, assistant_model=draft, **kw)
    assert assisted.shape[1] == x.shape[1] + 12 and torch.equal(assisted, plain)


def test_round_trip_logits_on_kept_ids_are_identical(made):
    _, d, src = made
    loaded = load_model(d, "bfloat16")
    assert isinstance(loaded, PrunedHeadLlamaForCausalLM) and loaded.lm_head.ids.tolist() == HEAD
    x = torch.tensor([[1, 4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        a, b = src(x).logits, loaded(x).logits  # src was cast to bf16 by write_draft
    assert torch.equal(a[..., HEAD], b[..., HEAD])
    others = sorted(set(range(V)) - set(HEAD))
    assert (b[..., others] == MASKED_LOGIT).all()


def _to_old_format(d):
    """Rewrite a draft directory as format 1 wrote it (custom model_type, ids as a tensor)."""
    meta = json.loads((d / DRAFT_META).read_text())
    ids = meta.pop("head_ids")
    meta["schema_version"] = 1
    (d / DRAFT_META).write_text(json.dumps(meta, indent=1))
    conf = json.loads((d / "config.json").read_text())
    conf |= {"model_type": OLD_MODEL_TYPE, "architectures": ["PrunedHeadLlamaForCausalLM"],
             "head_size": len(ids)}
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    state = load_file(d / "model.safetensors") | {"lm_head.ids": torch.tensor(ids)}
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def test_old_format_is_refused_in_one_line_then_converted(made, tmp_path, capsys):
    t, d, _ = made
    old = tmp_path / "old"
    shutil.copytree(d, old)
    _to_old_format(old)
    with pytest.raises(ModelError, match="training.convert_draft") as e:
        load_model(old)
    assert "\n" not in str(e.value)
    rc = generate_main(["--prompt", "ABC", "--target", str(t), "--draft", str(old),
                        "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "convert_draft" in err
    assert convert(old) is True and convert(old) is False  # idempotent
    for f in d.iterdir():  # the same files as a fresh write; weights byte for byte
        assert (old / f.name).read_bytes() == f.read_bytes() or f.name == DRAFT_META, f.name
    assert json.loads((old / DRAFT_META).read_text())["head_ids"] == HEAD
    x = torch.tensor([[1, 7, 7, 3]])
    with torch.no_grad():
        assert torch.equal(load_model(old)(x).logits, load_model(d)(x).logits)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def _cli_error(capsys, t, d):
    rc = generate_main(["--prompt", "ABC", "--target", str(t), "--draft", str(d),
                        "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("role", ["draft", "target"])
def test_truncated_weights_fail_in_one_line(made, tmp_path, capsys, role):
    t, d, _ = made
    bad = tmp_path / role
    shutil.copytree(t if role == "target" else d, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ModelError, match="cannot load model from"):
        load_model(bad)
    rc, err = _cli_error(capsys, bad if role == "target" else t, bad if role == "draft" else d)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: cannot load model from")


@pytest.mark.parametrize("role", ["draft", "target"])
def test_weights_of_the_wrong_shape_fail_in_one_line(made, tmp_path, capsys, role):
    t, d, _ = made
    bad = tmp_path / role
    shutil.copytree(t if role == "target" else d, bad)
    conf = LlamaConfig.from_pretrained(bad)
    conf.hidden_size, conf.head_dim = 16, 8  # a checkpoint of another model swapped in
    other = LlamaForCausalLM(conf)
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"
               or not conf.tie_word_embeddings}, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="does not match config.json"):
        load_model(bad)
    rc, err = _cli_error(capsys, bad if role == "target" else t, bad if role == "draft" else d)
    assert rc == 2 and err.count("\n") == 1 and "does not match config.json" in err
