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
from transformers import LlamaForCausalLM

from decoding.models import (
    MASKED_LOGIT,
    ModelError,
    PrunedHeadLlamaForCausalLM,
    check_pair,
    load_model,
    load_tokenizer,
)
from training.draft.distill import export_draft
from training.draft.module import DistillModule, DraftConfig, bucket_loss, select_head_ids
from training.draft.teacher_cache import load_cache

from support.distill import (
    EOS,
    ROOT,
    TINY_DRAFT,
    V,
    data_module,
    tiny_tokenizer,
    trainer,
)


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


@pytest.mark.slow
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
    from training.draft.scaling import training_tokens

    full, part = data_module(corpus_dir), data_module(corpus_dir, max_rows=10)
    for dm in (full, part):
        dm.setup("fit")
    assert len(part.train_rows) == 10 < len(full.train_rows)
    assert [r.completion for r in part.val_rows] == [r.completion for r in full.val_rows]
    assert training_tokens(corpus_dir, 10, full.val_percent) == sum(len(r.completion) for r in part.train_rows)
    assert training_tokens(corpus_dir, None, full.val_percent) == full.train_tokens()


def test_scaling_trend_recovers_a_log_law():
    from training.draft.scaling import fit_trend

    pts = [{"tokens": t, "best_agree": 0.1 + 0.05 * math.log(t)} for t in (1e4, 1e5, 1e6)]
    tr = fit_trend(pts, 0.6)
    assert tr["b_per_ln_tokens"] == pytest.approx(0.05) and tr["a"] == pytest.approx(0.1)
    assert tr["tokens_for_goal"] == pytest.approx(math.exp(10.0), rel=1e-6)
