"""Training the feature (EAGLE-3) head on a tiny random target: cache, loss, resume, refusal."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.head import LAYERS, data, make_head_target, teacher_of
from support.distill import EOS, trainer

from decoding.models import load_model
from training.draft.distill import target_fingerprint
from training.head.cache import CacheSettings, ShardReader, build, cached, target_batch
from training.head.module import FeatureDistillModule


def settings() -> CacheSettings:
    return CacheSettings(LAYERS, draft_vocab_size=40, k=8, max_prompt_tokens=16)


def test_cache_round_trips_and_is_incremental(head_corpus):
    target, corpus, cache = head_corpus
    teacher = teacher_of(target)
    folder, vocab = build([str(corpus)], cache, settings(), teacher, progress=False)
    assert len(vocab.used) == 40 and int(vocab.t2d.sum()) == 40
    assert torch.equal(vocab.d2t + torch.arange(40), vocab.used)
    assert EOS in vocab.used.tolist()
    from training.corpus.teacher import read_manifest

    m = read_manifest(corpus)
    files = cached(folder, corpus, m)
    assert len(files) == len(m["shards"])
    stamps = [p.stat().st_mtime_ns for _, p in files]
    build([str(corpus)], cache, settings(), teacher, progress=False)  # nothing left to do
    assert [p.stat().st_mtime_ns for _, p in files] == stamps

    shard, path = files[1]
    row = ShardReader(path, shard, vocab.sha256()).row(3)
    ids = row["ids"][None]
    ref = target_batch(teacher.model, ids, torch.ones_like(ids), torch.tensor([row["label_start"]]),
                       LAYERS, vocab.used, 8)
    torch.testing.assert_close(row["feats"].float(), ref["feats"][0], atol=2e-2, rtol=1e-2)
    assert torch.equal(row["top1"], ref["top1"][0][ref["lab_mask"][0]])
    assert torch.equal(row["lab_ids"], ref["lab_ids"][0][ref["lab_mask"][0]])
    # the labels are the target's distribution restricted to the draft vocabulary
    with torch.no_grad():
        full = torch.log_softmax(teacher.model(input_ids=ids).logits[0].float(), -1)
    restricted = torch.log_softmax(full[:, vocab.used], -1)[ref["lab_mask"][0]]
    torch.testing.assert_close(row["lab_logp"].float(), restricted.topk(8, -1).values,
                               atol=1e-2, rtol=1e-2)


def test_online_batch_equals_cached_batch(head_corpus):
    cached_dm, online_dm = data(head_corpus), data(head_corpus, source="online")
    for dm in (cached_dm, online_dm):
        dm.prepare_data()
        dm.setup("fit")
    assert torch.equal(cached_dm.vocab.used, online_dm.vocab.used)
    a = next(iter(cached_dm.val_dataloader()))
    b = next(iter(online_dm.val_dataloader()))
    assert torch.equal(a["input_ids"], b["input_ids"])
    module = FeatureDistillModule(target=cached_dm.target)
    module._target.append(load_model(cached_dm.target))
    ref = target_batch(module.target(), b["input_ids"], b["attention_mask"], b["label_start"],
                       LAYERS, online_dm.vocab.used, 8)
    assert torch.equal(ref["lab_mask"], a["lab_mask"])
    assert torch.equal(ref["top1"][ref["lab_mask"]], a["top1"][a["lab_mask"]])
    torch.testing.assert_close(ref["feats"] * a["attention_mask"][..., None], a["feats"],
                               atol=2e-2, rtol=1e-2)


def test_a_bf16_teacher_labels_the_same_rows_in_float32(head_corpus, monkeypatch):
    """teacher_dtype: the online prefill runs in bf16 (auto: where the CPU computes it natively)
    and hands the head float32 features close to float32's; the head stays float32."""
    import decoding.forward.cpu as cpu
    from training.head.module import resolve_teacher_dtype

    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    assert resolve_teacher_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_teacher_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    assert resolve_teacher_dtype("auto", torch.device("cpu")) == "bfloat16"
    assert resolve_teacher_dtype("float32", torch.device("cpu")) == "float32"
    with pytest.raises(ValueError, match="teacher_dtype"):
        FeatureDistillModule(teacher_dtype="float16")

    dm = data(head_corpus, source="online")
    dm.prepare_data()
    dm.setup("fit")
    b = next(iter(dm.val_dataloader()))
    out = {}
    for dtype in ("float32", "bfloat16"):
        module = FeatureDistillModule(target=dm.target, teacher_dtype=dtype)
        module.build_head(dm.layers, dm.vocab.used)
        module.online_k = 8
        out[dtype] = module._online(b)
        assert all(p.dtype == torch.float32 for p in module.head.parameters())
        assert module.target().dtype == torch.float32  # the head's shared embedding stays fp32
    a, h = out["float32"], out["bfloat16"]
    assert h["feats"].dtype == torch.float32 and torch.equal(a["lab_mask"], h["lab_mask"])
    m = a["attention_mask"].bool()
    assert not torch.equal(a["feats"][m], h["feats"][m]), "the bf16 prefill ran"
    torch.testing.assert_close(h["feats"][m], a["feats"][m], atol=0.1, rtol=0.05)
    assert (a["top1"] == h["top1"])[a["lab_mask"]].float().mean() > 0.9


class Record(__import__("lightning").Callback):
    def __init__(self):
        self.losses, self.steps = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        self.losses.append(float(outputs["loss"]))
        self.steps.append(trainer.global_step)


def test_loss_falls_and_step1_agreement_rises(head_corpus):
    torch.manual_seed(0)
    dm = data(head_corpus)
    module = FeatureDistillModule(target=dm.target, steps=3, lr=1e-2, schedule="steps")
    before = trainer().validate(module, datamodule=dm, verbose=False)[0]
    rec = Record()
    t = trainer(max_steps=80, callbacks=[rec], val_check_interval=1.0,
                check_val_every_n_epoch=1000)
    t.fit(module, datamodule=dm)
    after = trainer().validate(module, datamodule=dm, verbose=False)[0]
    first, last = sum(rec.losses[:5]) / 5, sum(rec.losses[-5:]) / 5
    assert last < 0.8 * first
    assert after["val/agree_1"] > before["val/agree_1"] + 0.1
    assert {"val/agree_2", "val/agree_3", "val/agree_1_code", "val/agree_1_general"} <= set(after)


def test_resume_continues_the_step_count(head_corpus, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt=None):
        rec = Record()
        cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, enable_version_counter=False)
        t = trainer(max_steps=max_steps, callbacks=[rec, cb], enable_checkpointing=True,
                    limit_val_batches=0)
        m = FeatureDistillModule(target=str(head_corpus[0]), steps=2, schedule="steps")
        t.fit(m, datamodule=data(head_corpus), ckpt_path=ckpt)
        return rec, t

    run(4)
    assert (tmp_path / "last.ckpt").is_file()
    rec, t = run(8, str(tmp_path / "last.ckpt"))
    assert rec.steps[0] == 5 and t.global_step == 8

    from training.head.train import load_feature_module

    m = load_feature_module(tmp_path / "last.ckpt")
    assert m.head is not None and m.hp["steps"] == 2


def test_refuses_a_corpus_of_another_target(head_corpus, tmp_path):
    other = make_head_target(tmp_path / "other", seed=5)
    dm = data(head_corpus, target=str(other), cache_root=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="written for target"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="not the loaded one"):
        build([str(head_corpus[1])], tmp_path / "cache", settings(), replace(teacher_of(other)),
              progress=False)


def test_distill_dispatches_eagle3_configs_and_exports(head_corpus, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)  # LightningCLI writes its config.yaml into the working directory

    import yaml

    from training.draft.distill import main

    target, corpus, cache = head_corpus
    conf = {
        "run": {"kind": "eagle3", "name": "head", "drafts": str(tmp_path / "drafts"), "threads": 1},
        "model": {"target": str(target), "steps": 2, "schedule": "steps"},
        "data": {"corpora": [str(corpus)], "target": str(target), "cache_root": str(cache),
                 "draft_vocab_size": 40, "k": 8, "layers": LAYERS, "max_prompt_tokens": 16,
                 "max_tokens": 256, "val_percent": 20, "max_val_rows": 16},
        "trainer": {"accelerator": "cpu", "max_steps": 3, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True,
                                                 "monitor": "val/agree", "mode": "max"}}]},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf))
    main(["--config", str(path)])
    out = tmp_path / "drafts" / "head"
    meta = json.loads((out / "specstop_draft.json").read_text())
    assert meta["draft_kind"] == "eagle3" and meta["corpus_target"] == target_fingerprint(str(target))
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert meta["metrics"]["validation"]["global_step"] == 3  # the last step, validated at max_steps
    from decoding.drafts.io import load_feature_draft

    head = load_feature_draft(out, load_model(target))  # loads back for its own target
    assert head.config.aux_layers == tuple(LAYERS) and head.config.draft_vocab_size == 40
    assert meta["dtype"] == "bfloat16"  # the committed head is 16-bit

    # a later run warm-starts from the exported head (runs/ does not travel between machines)
    warm = FeatureDistillModule(target=str(target), warm_start=str(out))
    again = warm.build_head(LAYERS, head.used_ids)
    assert torch.equal(again.fc.weight, head.fc.weight.float())
    other = torch.arange(40) if not torch.equal(head.used_ids, torch.arange(40)) else torch.arange(1, 41)
    with pytest.raises(ValueError, match="vocabulary"):
        warm.build_head(LAYERS, other)

    other = make_head_target(tmp_path / "other", seed=5)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(path), "--data.target", str(other), "--model.target", str(other)])
    assert e.value.code == 2


def test_skipped_prompt_rows_leave_the_loss_unchanged(head_corpus, monkeypatch):
    """The loss with later steps cut to the labelled rows equals the loss over every row."""
    import training.head.module as fm

    dm = data(head_corpus)
    dm.prepare_data()
    dm.setup("fit")
    from training.head.data import collate

    rows = [r for r in map(dm._load, dm.train_rows) if r["label_start"] >= 4][:4]
    batch = collate(rows)
    assert fm.unroll_skip(batch, 2) > 0  # the longest tiny prompts leave rows to skip
    module = FeatureDistillModule(target=dm.target, steps=2)
    module.build_head(dm.layers, dm.vocab.used)
    with torch.no_grad():
        cut, per_cut = module._step(batch)
        monkeypatch.setattr(fm, "unroll_skip", lambda b, s: 0)
        full, per_full = module._step(batch)
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)
    for (lc, ac, _, xc, _), (lf, af, _, xf, _) in zip(per_cut, per_full):
        torch.testing.assert_close(lc, lf, rtol=1e-5, atol=1e-5)
        assert torch.equal(ac, af)
        torch.testing.assert_close(xc, xf, rtol=1e-5, atol=1e-5)  # expected acceptance


def test_freeze_output_trains_only_fc_and_midlayer(head_corpus):
    dm = data(head_corpus)
    dm.prepare_data()  # the cache: on its own (an xdist worker without the module's earlier tests) none is there
    dm.setup("fit")
    module = FeatureDistillModule(target=dm.target, steps=2, init="output", freeze_output=True)
    head = module.build_head(dm.layers, dm.vocab.used)
    t = module.target()
    assert torch.equal(head.lm_head.weight, t.get_output_embeddings().weight[head.used_ids].float())
    trained = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("fc.", "midlayer.")) for n in trained)
    with pytest.raises(ValueError, match="init must be"):
        FeatureDistillModule(init="bogus")


def test_shipped_eagle3_configs_train_then_continue_on_a_tiny_target(head_corpus, tmp_path, monkeypatch):
    """configs/distill_eagle3.yaml, then the same with configs/distill_eagle3_continue.yaml laid
    over it (online source, warm start from the exported head, its vocabulary), only the models,
    data and sizes overridden; relative paths land in the test's working directory."""
    import hashlib
    import json

    from support.distill import ROOT

    from training.draft.distill import main

    monkeypatch.chdir(tmp_path)
    target, corpus, cache = head_corpus
    tiny_args = ["--model.target", str(target), "--model.steps", "2", "--model.schedule", "steps",
                 "--data.target", str(target), "--data.corpora", json.dumps([str(corpus)]),
                 "--data.cache_root", str(cache), "--data.draft_vocab_size", "40", "--data.k", "8",
                 "--data.layers", json.dumps(LAYERS), "--data.max_prompt_tokens", "16",
                 "--data.max_tokens", "256", "--data.val_percent", "20", "--data.max_val_rows", "16",
                 "--run.threads", "1", "--trainer.max_time", "null", "--trainer.max_steps", "3",
                 "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"]
    base = ["--config", str(ROOT / "configs/distill_eagle3.yaml")]
    main(base + tiny_args)
    shipped = tmp_path / "checkpoints" / "drafts" / "smollm2-135m-eagle3"
    digest = hashlib.sha256((shipped / "model.safetensors").read_bytes()).hexdigest()

    # no cache to read: the continuation runs the target's prefill itself (source online)
    main(base + ["--config", str(ROOT / "configs/distill_eagle3_continue.yaml")] + tiny_args
         + ["--data.cache_root", str(tmp_path / "no-cache"), "--data.build_cache", "false"])
    out = tmp_path / "runs" / "drafts" / "smollm2-135m-eagle3"
    meta, first = (json.loads((d / "specstop_draft.json").read_text()) for d in (out, shipped))
    assert meta["training"]["warm_start"] == "checkpoints/drafts/smollm2-135m-eagle3"
    assert meta["data"]["vocab_sha256"] == first["data"]["vocab_sha256"]
    assert (tmp_path / "runs" / "distill" / "smollm2-135m-eagle3-continue" / "checkpoints" / "last.ckpt").is_file()
    # the continuation never writes over the head it started from
    assert hashlib.sha256((shipped / "model.safetensors").read_bytes()).hexdigest() == digest
