"""Draft distillation on tiny models: KD learns, LoRA round trip, export, tokenizer check, ddp."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decoding.models import (
    MASKED_LOGIT,
    ModelError,
    PrunedHeadLlamaForCausalLM,
    check_pair,
    load_model,
    load_tokenizer,
)
from training.corpus import CorpusConfig, Prompt, Teacher, build_corpus
from training.distill import export_draft
from training.distill_data import CorpusDataModule
from training.distill_module import DistillModule, DraftConfig, bucket_loss, select_head_ids
from training.teacher_cache import build_cache, load_cache

ROOT = Path(__file__).resolve().parent.parent
V, EOS, PAD = 64, 2, 0
TINY_DRAFT = DraftConfig(layers=1, hidden=32, heads=2, intermediate=64, head_size=48)


def tiny_tokenizer(path: Path, shift: int = 0) -> None:
    """A word-level tokenizer over V single-character tokens; `shift` permutes the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(ord("A") + i) for i in range(V - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: 3 + (i + shift) % (V - 3) for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny, sharp random Llama target saved as an HF directory with a tokenizer."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(3)  # sharp next-token distributions: a learnable target
    out = tmp_path_factory.mktemp("target")
    model.save_pretrained(out)
    tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def corpus_dir(target_dir, tmp_path_factory) -> Path:
    """A toy corpus written by the tiny target, with its teacher top-k cached."""
    model = load_model(target_dir)
    teacher = Teacher(model, lambda t: [1] + [3 + ord(c) % 60 for c in t], [EOS], PAD,
                      {"name": "tiny", "vocab_size": V})
    prompts = [Prompt(f"p{i}", "code" if i % 3 else "general", "train", "abcde"[i % 5] * (1 + i % 4))
               for i in range(48)]
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(CorpusConfig(out=str(out), dtype="float32", batch_size=8, shard_size=16,
                              max_new_tokens=24, temperature=1.0), teacher, prompts, progress=False)
    build_cache(out, out / "cache", k=8, teacher=teacher, progress=False)
    return out


def data_module(corpus_dir, **kw) -> CorpusDataModule:
    args = {"corpus": str(corpus_dir), "teacher_cache": str(corpus_dir / "cache"), "k": 8,
            "batch_size": 8, "val_percent": 20, "max_val_rows": 16, "refresh": False}
    return CorpusDataModule(**(args | kw))


def trainer(**kw) -> L.Trainer:
    args = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(**(args | kw))


def test_cache_rows_align_with_corpus(corpus_dir):
    shards, rows = load_cache(corpus_dir, corpus_dir / "cache", k=8, partial=False)
    assert len(shards) == 3 and rows.ids.shape[1] == 8
    n = sum(s["rows"] for s in shards)
    assert len(rows.offsets) == n + 1 and int(rows.offsets[-1]) == len(rows.ids)
    assert torch.all(rows.logp[:, :-1] >= rows.logp[:, 1:])  # most likely first
    assert torch.all(rows.logp.float().exp().sum(-1) <= 1.001)


def test_kd_loss_falls_and_agreement_rises(target_dir, corpus_dir):
    L.seed_everything(0)
    dm = data_module(corpus_dir)
    draft = DraftConfig(**(vars(TINY_DRAFT) | {"embed_init": "random"}))
    module = DistillModule(draft=draft, target=str(target_dir), lr=1e-2, warmup_steps=5,
                           schedule="steps", k=8)
    t = trainer(max_epochs=12, num_sanity_val_steps=0)
    before = t.validate(module, datamodule=dm, verbose=False)[0]
    t.fit(module, datamodule=dm)
    after = trainer().validate(module, datamodule=dm, verbose=False)[0]
    assert after["val/loss"] < 0.7 * before["val/loss"]
    assert after["val/agree"] > before["val/agree"] + 0.2
    assert after["val/accept"] > before["val/accept"]
    # the pruned head scores exactly the ids it was built from (+ EOS/BOS always)
    ids = module.base().lm_head.ids
    assert len(ids) == 48 and {1, EOS} <= set(ids.tolist())


@pytest.mark.parametrize("mode", ["online", "on_policy"])
def test_online_teacher_and_on_policy_batches_train(target_dir, corpus_dir, mode):
    L.seed_everything(0)
    dm = data_module(corpus_dir, teacher="online" if mode == "online" else "cached")
    module = DistillModule(draft=TINY_DRAFT, target=str(target_dir), k=8, schedule="steps",
                           on_policy_every=1 if mode == "on_policy" else 0, on_policy_tokens=6)
    t = trainer(max_steps=3, num_sanity_val_steps=0, limit_val_batches=1)
    t.fit(module, datamodule=dm)
    prefix = "train_op" if mode == "on_policy" else "train"
    assert torch.isfinite(t.callback_metrics[f"{prefix}/loss"])
    val = trainer(limit_val_batches=1).validate(module, datamodule=dm, verbose=False)[0]
    assert 0 <= val["val/agree"] <= 1


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tv", "ce"])
def test_bucket_losses_are_zero_at_the_teacher(kind):
    torch.manual_seed(0)
    logits = torch.randn(5, V) * 3
    lp = torch.log_softmax(logits, -1)
    t_logp, t_ids = lp.topk(8, -1)
    loss, stats = bucket_loss(logits, None, t_ids, t_logp, t_ids[:, 0], kind)
    if kind == "ce":
        assert torch.allclose(loss, -t_logp[:, 0].mean(), atol=1e-5)
    else:
        assert abs(float(loss)) < 1e-4
    assert stats["agree"].mean() == 1.0
    other, _ = bucket_loss(torch.randn(5, V), None, t_ids, t_logp, t_ids[:, 0], kind)
    assert other > loss


def test_select_head_ids_keeps_frequent_and_forced():
    ids = select_head_ids({5: 10, 7: 3, 9: 8}, vocab=20, size=4, always=[2])
    assert ids.tolist() == [2, 5, 7, 9]


def test_lora_adapter_save_load_merge_same_logits(target_dir, tmp_path):
    from peft import PeftModel

    module = DistillModule(draft=DraftConfig(init=str(target_dir), lora=True, lora_r=4),
                           target=str(target_dir))
    with torch.no_grad():  # LoRA B starts at zero: make the adapter matter
        for n, p in module.draft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    x = torch.randint(0, V, (2, 12))
    module.draft.eval()
    with torch.no_grad():
        ref = module.draft(input_ids=x).logits
    module.draft.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(load_model(target_dir), tmp_path / "adapter").eval()
    base = load_model(target_dir)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, ref, atol=1e-5)
        assert not torch.allclose(base(input_ids=x).logits, ref, atol=1e-3)
        merged = loaded.merge_and_unload()
        assert torch.allclose(merged(input_ids=x).logits, ref, atol=1e-4)
    # export merges the adapter for serving and keeps it beside the weights
    out = export_draft(module, tmp_path / "drafts" / "lora", {"kind": "test"}, "bfloat16")
    assert (out / "adapter" / "adapter_config.json").exists()
    served = load_model(out)
    assert type(served) is LlamaForCausalLM
    with torch.no_grad():
        assert (served(input_ids=x).logits - ref).abs().max() < 0.15  # bf16 weights


def test_export_load_round_trip_passes_check_pair(target_dir, corpus_dir, tmp_path):
    module = DistillModule(draft=TINY_DRAFT, target=str(target_dir))
    trainer(max_steps=1, num_sanity_val_steps=0).fit(module, datamodule=data_module(corpus_dir))
    meta = {"kind": "specstop-draft", "target": {"name": "tiny"}}
    out = export_draft(module, tmp_path / "drafts" / "d", meta, "bfloat16")
    assert json.loads((out / "specstop_draft.json").read_text())["target"] == {"name": "tiny"}
    assert not list(out.parent.glob(".*tmp*"))  # atomic: no temp dir left behind
    draft, target = load_model(out), load_model(target_dir)
    assert isinstance(draft, PrunedHeadLlamaForCausalLM)
    assert stored_dtype(out) == torch.bfloat16
    check_pair(target, draft, load_tokenizer(target_dir), load_tokenizer(out))
    x = torch.randint(0, V, (1, 10))
    module.draft.eval()
    with torch.no_grad():
        got, ref = draft.float()(input_ids=x).logits, module.draft(input_ids=x).logits
    kept = torch.zeros(V, dtype=torch.bool)
    kept[draft.lm_head.ids] = True
    assert torch.all(got[..., ~kept] == MASKED_LOGIT)
    assert (got[..., kept] - ref[..., kept]).abs().max() < 0.1
    # re-export replaces the directory in place
    export_draft(module, out, meta, "float16")
    assert stored_dtype(out) == torch.float16


def stored_dtype(folder: Path) -> torch.dtype:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight").dtype


def test_draft_with_other_tokenizer_is_refused(target_dir, tmp_path):
    other = tmp_path / "other"
    load_model(target_dir).save_pretrained(other)
    tiny_tokenizer(other, shift=5)
    with pytest.raises(ModelError, match="tokenizer"):
        check_pair(load_model(target_dir), load_model(other), load_tokenizer(target_dir),
                   load_tokenizer(other))


def test_ddp_two_processes_on_cpu(target_dir, corpus_dir, tmp_path):
    """`--trainer.strategy ddp --trainer.devices 2` on CPU (gloo), unchanged config (~10 s)."""
    cfg = {
        "seed_everything": 0,
        "run": {"name": "ddp", "drafts": str(tmp_path / "drafts"), "threads": 1},
        "model": {"draft": {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64,
                            "head_size": 48}, "target": str(target_dir), "k": 8},
        "data": {"corpus": str(corpus_dir), "teacher_cache": str(corpus_dir / "cache"), "k": 8,
                 "batch_size": 4, "val_percent": 20, "max_val_rows": 8},
        "trainer": {"max_steps": 4, "val_check_interval": 2, "check_val_every_n_epoch": None,
                    "enable_progress_bar": False, "logger": False, "precision": "bf16-mixed",
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "ck"),
                                                 "monitor": "val/agree", "mode": "max",
                                                 "save_last": True, "filename": "best"}}]},
    }
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "training.distill", "--config", str(tmp_path / "c.yaml"),
         "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ck" / "last.ckpt").exists()
    out = tmp_path / "drafts" / "ddp"
    meta = json.loads((out / "specstop_draft.json").read_text())
    assert meta["data"]["train_completion_tokens"] > 0
    assert "val/agree" in meta["metrics"]["validation"]


def test_max_rows_keeps_the_validation_set_and_counts_tokens(corpus_dir):
    from training.distill_scaling import training_tokens

    full, part = data_module(corpus_dir), data_module(corpus_dir, max_rows=10)
    for dm in (full, part):
        dm.setup("fit")
    assert len(part.train_rows) == 10 < len(full.train_rows)
    assert [r.completion for r in part.val_rows] == [r.completion for r in full.val_rows]
    assert training_tokens(corpus_dir, 10, full.val_percent) == sum(len(r.completion) for r in part.train_rows)
    assert training_tokens(corpus_dir, None, full.val_percent) == full.train_tokens()


def test_scaling_trend_recovers_a_log_law():
    from training.distill_scaling import fit_trend

    pts = [{"tokens": t, "best_agree": 0.1 + 0.05 * math.log(t)} for t in (1e4, 1e5, 1e6)]
    tr = fit_trend(pts, 0.6)
    assert tr["b_per_ln_tokens"] == pytest.approx(0.05) and tr["a"] == pytest.approx(0.1)
    assert tr["tokens_for_goal"] == pytest.approx(math.exp(10.0), rel=1e-6)


@pytest.fixture(scope="module")
def on_policy_dir(target_dir, corpus_dir, tmp_path_factory) -> Path:
    """An on-policy corpus for the tiny target: a random draft writes, the target scores."""
    from dataclasses import replace

    target = load_model(target_dir)
    teacher = Teacher(target, lambda t: [1] + [3 + ord(c) % 60 for c in t], [EOS], PAD,
                      {"name": "tiny", "vocab_size": V})
    torch.manual_seed(3)
    draft = LlamaForCausalLM(target.config).eval()
    writer = replace(teacher, model=draft, info=teacher.info | {"writer": {"name": "rnd"}})
    prompts = [Prompt(f"p{i}", "general", "train", "abcde"[i % 5] * (1 + i % 4)) for i in range(48)]
    out = tmp_path_factory.mktemp("onpolicy")
    build_corpus(CorpusConfig(out=str(out), dtype="float32", batch_size=8, shard_size=16,
                              max_new_tokens=24, temperature=1.0, seed=7), writer, prompts,
                 progress=False)
    build_cache(out, corpus_dir / "cache", k=8, teacher=teacher, progress=False)
    return out


def test_extra_corpora_add_training_rows_only(corpus_dir, on_policy_dir, tmp_path):
    from training.distill_data import is_val

    base, both = data_module(corpus_dir), data_module(corpus_dir, extra_corpora=[str(on_policy_dir)])
    for dm in (base, both):
        dm.setup("fit")
    extra = [r for r in both.train_rows if not r.target_written]
    assert len(both.train_rows) == len(base.train_rows) + len(extra) and extra
    assert [r.completion for r in both.val_rows] == [r.completion for r in base.val_rows]
    # validation prompts' on-policy rows are neither trained nor validated on
    from training.corpus import load_corpus

    op = load_corpus(on_policy_dir).to_list()
    assert len(extra) == sum(not is_val(r["prompt_id"], 20) for r in op) < len(op)
    # a recipe stage can keep to the shards its writers wrote (by the name each shard records)
    for writers, n in ((["rnd"], len(extra)), (["another-draft"], 0)):
        dm = data_module(corpus_dir, extra_corpora=[str(on_policy_dir)], extra_writers=writers)
        dm.setup("fit")
        assert sum(not r.target_written for r in dm.train_rows) == n
    # the draft's own tokens do not vote for the output head, the target's top-1 there does
    counts = both.token_counts()
    assert sum(counts.values()) == (sum(base.token_counts().values())
                                    + sum(len(r.completion) for r in extra))
    # a corpus written for another target is refused
    other = tmp_path / "other"
    other.mkdir()
    man = json.loads((on_policy_dir / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(man | {"target": {"name": "x"}}))
    with pytest.raises(ValueError, match="another target"):
        data_module(corpus_dir, extra_corpora=[str(other)]).setup("fit")


def test_grown_draft_starts_as_the_warm_start_and_reselects_its_head(target_dir, corpus_dir,
                                                                     tmp_path):
    module = DistillModule(draft=TINY_DRAFT, target=str(target_dir))
    trainer(max_steps=2, num_sanity_val_steps=0).fit(module, datamodule=data_module(corpus_dir))
    src = export_draft(module, tmp_path / "drafts" / "v1", {"kind": "test"}, "bfloat16")
    old = load_model(src)
    with torch.no_grad():  # a head that misses frequent ids, so re-picking must change it
        old.set_head_ids(torch.arange(V - 48, V))
    old.save_pretrained(src)
    grown = DistillModule(draft=DraftConfig(init=str(src), grow_layers=2, reselect_head=True),
                          target=str(target_dir))
    assert grown.base().config.num_hidden_layers == 3 == len(grown.base().model.layers)
    x = torch.randint(0, V, (2, 12))
    grown.draft.eval()
    with torch.no_grad():  # new layers are the identity: same function as the warm start
        assert torch.allclose(grown.draft(input_ids=x).logits, old(input_ids=x).logits, atol=1e-5)
    t = trainer(max_steps=3, num_sanity_val_steps=0)
    t.fit(grown, datamodule=data_module(corpus_dir))
    ids = grown.base().lm_head.ids
    assert {1, EOS} <= set(ids.tolist()) and not torch.equal(ids, torch.arange(V - 48, V))
    assert grown.base().model.layers[2].self_attn.o_proj.weight.abs().sum() > 0  # it trains
    out = export_draft(grown, tmp_path / "drafts" / "v2", {"kind": "test"}, "bfloat16")
    served = load_model(out)
    assert served.config.num_hidden_layers == 3 and torch.equal(served.lm_head.ids, ids)


def test_draft_cost_refuses_a_missing_draft_with_one_line(tmp_path):
    from training import draft_cost

    with pytest.raises(SystemExit, match="error: model directory not found"):
        draft_cost.main(["--draft", str(tmp_path / "nope")])


def test_learning_curves_chain_across_warm_started_stages(tmp_path):
    from training.distill_eval import learning_curve

    def csv(name: str, agree: list[float]) -> Path:
        rows = ["step,train_minutes,val/agree"] + [f"{i},{i + 1.0},{a}" for i, a in enumerate(agree)]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
        return tmp_path / name

    one = learning_curve(csv("1.csv", [0.3, 0.4]), tmp_path / "1.png")
    two = learning_curve(csv("2.csv", [0.45, 0.5]), tmp_path / "2.png", one)
    three = learning_curve(csv("3.csv", [0.52]), tmp_path / "3.png", two)
    assert [q["stage"] for q in three] == [1, 1, 2, 2, 3]
    assert [q["total_minutes"] for q in three] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [q["val/agree"] for q in three] == [0.3, 0.4, 0.45, 0.5, 0.52]
    # a curve written before stages were recorded (no stage / total_minutes) is stage 1
    legacy = [{k: v for k, v in q.items() if k not in ("stage", "total_minutes")} for q in one]
    assert learning_curve(csv("2.csv", [0.45, 0.5]), tmp_path / "x.png", legacy) == two
    assert (tmp_path / "3.png").stat().st_size > 0
