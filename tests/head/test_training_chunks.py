"""Committed training chunks (training/head/chunks.py, chunk_run.py): a run continued on a "new
machine" from its chunk alone equals the uninterrupted run; a chunk of another run is refused;
an interrupted write leaves the old chunk whole."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from lightning import Callback
from support.head import LAYERS, make_head

from training.head import chunks as C

STEPS = 10


class Losses(Callback):
    def __init__(self, out: dict):
        self.out = out

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        self.out[trainer.global_step] = float(outputs["loss"])


def config(tmp_path, head_corpus, run: dict | None = None, model: dict | None = None,
           steps: int = STEPS) -> list[str]:
    """A 10-step run under tmp_path, compared with the head at ./shipped (the working directory)."""
    target, corpus, cache = head_corpus
    tmp_path.mkdir(exist_ok=True)
    conf = {
        "seed_everything": 0,
        "run": {"kind": "eagle3", "name": "head", "drafts": str(tmp_path / "drafts"), "threads": 1,
                "export": False, "chunks": str(tmp_path / "chunks"), "commit_every_minutes": None,
                "heldout_rows": 6, "baseline": "shipped"} | (run or {}),
        "model": {"target": str(target), "steps": 2, "schedule": "steps", "lr": 0.01, "warmup_ratio": 0.2}
        | (model or {}),
        "data": {"corpora": [str(corpus)], "target": str(target), "cache_root": str(cache),
                 "draft_vocab_size": 40, "k": 8, "layers": LAYERS, "max_prompt_tokens": 16,
                 "max_tokens": 256, "val_percent": 20, "max_val_rows": 16},
        "trainer": {"accelerator": "cpu", "max_steps": steps, "max_epochs": 100, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "reload_dataloaders_every_n_epochs": 1, "val_check_interval": 3,
                    "check_val_every_n_epoch": None,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "runs" / "ckpt"), "save_last": True,
                                                 "monitor": "val/agree", "mode": "max"}}]},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf))
    return ["--config", str(path)]


def train(argv, monkeypatch, losses: dict):
    """One session through the CLI, its per-step losses recorded; returns the head's weights."""
    from training.head import train as T

    seen = {}
    real = getattr(T.with_chunks, "real", T.with_chunks)  # not an earlier session's spy

    def spy(run, trainer, module, data, last):
        trainer.callbacks.insert(0, Losses(losses))
        seen["module"] = module
        return real(run, trainer, module, data, last)

    spy.real = real
    monkeypatch.setattr(T, "with_chunks", spy)
    from training.draft.distill import main

    main(argv)
    return {k: v.detach().clone() for k, v in seen["module"].head.state_dict().items()}


@pytest.fixture
def shipped(head_corpus, tmp_path):
    return make_head(head_corpus[0], tmp_path / "shipped", damaged=False)


def test_a_run_continued_from_its_chunk_equals_the_uninterrupted_run(head_corpus, tmp_path, monkeypatch, shipped):
    monkeypatch.chdir(tmp_path)
    whole: dict = {}
    ref = train(config(tmp_path / "a", head_corpus), monkeypatch, whole)
    assert sorted(whole) == list(range(1, STEPS + 1))

    # session 1 stops halfway; then a "new machine": runs/ is gone, only the committed chunk is left
    first: dict = {}
    b = tmp_path / "b"
    train(config(b, head_corpus, {"session_steps": 4}), monkeypatch, first)
    chunk = b / "chunks" / "head" / "latest"
    doc = C.read_meta(chunk)
    assert doc["global_step"] == 4 and doc["data_position"]["consumed"] >= 1
    assert doc["bytes"]["optimizer"] >= 2 * doc["bytes"]["model"] - 1024  # fp32 exp_avg + exp_avg_sq (frozen buffers aside)
    assert doc["corpora_manifests"] and doc["identity"]["vocab_sha256"]
    held = doc["heldout"]
    assert held["rows"] == 6 and "agree_step1" in held["chunk"] and "agree_step1" in held["shipped"]
    assert set(held["vs_shipped"]) >= {"agree_step1", "accepted_length"}
    assert json.loads((b / "chunks" / "head" / "best.json").read_text())["global_step"] == 4
    kept = json.dumps(doc["checkpoint"]["callbacks"]) + json.dumps(doc["files"])  # Lightning's own paths
    assert str(tmp_path) not in kept and f"{C.CWD}/b/runs/ckpt" in kept  # name no machine's folder
    assert (b / "chunks" / "head" / "best" / "model.safetensors").is_file()
    shutil.rmtree(b / "runs")
    second: dict = {}
    out = train(config(b, head_corpus), monkeypatch, second)

    assert sorted(second) == list(range(5, STEPS + 1))  # the step count goes on
    # the same batches in the same order, the same optimizer and schedule state: on a CPU (one
    # thread) the continuation is bitwise the uninterrupted run
    assert [second[s] for s in range(5, STEPS + 1)] == [whole[s] for s in range(5, STEPS + 1)]
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert C.read_meta(chunk)["global_step"] == STEPS


WSD = {"schedule": "wsd", "warmup_steps": 2, "decay_steps": 3}


def test_a_wsd_run_made_longer_before_its_decay_is_the_longer_run(head_corpus, tmp_path, monkeypatch, shipped):
    """A run planned for 10 steps, stopped at step 4 and continued on a "new machine" as a 14-step
    run, is bitwise the run planned for 14 steps from the start: a growing corpus can lengthen it."""
    monkeypatch.chdir(tmp_path)
    whole: dict = {}
    ref = train(config(tmp_path / "a", head_corpus, {"heldout_rows": 0}, WSD, steps=14), monkeypatch, whole)
    first: dict = {}
    b = tmp_path / "b"
    train(config(b, head_corpus, {"heldout_rows": 0, "session_steps": 4}, WSD, steps=10), monkeypatch, first)
    assert first == {s: whole[s] for s in range(1, 5)}
    shutil.rmtree(b / "runs")
    second: dict = {}
    out = train(config(b, head_corpus, {"heldout_rows": 0}, WSD, steps=14), monkeypatch, second)
    assert [second[s] for s in range(5, 15)] == [whole[s] for s in range(5, 15)]
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert C.read_meta(b / "chunks" / "head" / "latest")["identity"]["trainer"]["max_steps"] == 14


def test_only_a_wsd_run_before_its_decay_may_change_its_length():
    mine = {"target": {"name": "t"}, "vocab_sha256": "v", "data": {"corpora": ["c"]},
            "model": {"schedule": "wsd", "warmup_steps": 50, "decay_steps": 600},
            "trainer": {"max_steps": 6000, "accumulate_grad_batches": 1, "gradient_clip_val": 0.5}}

    def chunk(step, max_steps, **model):
        ident = json.loads(json.dumps(mine))
        ident["trainer"]["max_steps"], ident["model"] = max_steps, ident["model"] | model
        return {"global_step": step, "identity": ident}

    assert C.longer_wsd(chunk(3000, 4000), mine)            # before 3,400 and 5,400
    C.check_identity(chunk(3000, 4000), mine, "chunk")
    assert C.longer_wsd(chunk(3000, 9000), mine)            # shorter, still before both decays
    assert not C.longer_wsd(chunk(3500, 4000), mine)        # the 4,000-step run was decaying
    assert not C.longer_wsd(chunk(5500, 9000), mine)        # the 6,000-step run would decay from 5,400
    assert not C.longer_wsd(chunk(100, 4000, decay_steps=500), mine)  # another schedule
    with pytest.raises(C.ChunkError, match="max_steps = 4000, this run's 6000"):
        C.check_identity(chunk(3500, 4000), mine, "chunk")
    cosine = json.loads(json.dumps(mine))
    cosine["model"] = {"schedule": "steps"}
    stepped = chunk(10, 4000)
    stepped["identity"]["model"] = {"schedule": "steps"}
    with pytest.raises(C.ChunkError, match="max_steps"):
        C.check_identity(stepped, cosine, "chunk")


def test_the_wsd_factor():
    from training.head.module import FeatureDistillModule, wsd_factor

    f = [wsd_factor(s, 10, 2, 4, 0.1) for s in range(11)]
    assert f[0] == 1e-3 and f[1] == 0.5 and f[2:7] == [1.0] * 5
    assert f[7] == pytest.approx(0.1 + 0.9 * (1 - 0.5))  # a quarter into the decay: 1 - sqrt(1/4)
    assert f[10] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[2:], f[3:]))
    assert f[:6] == [wsd_factor(s, 1000, 2, 4, 0.1) for s in range(6)]  # the length shows only in the decay
    for bad in ({"schedule": "wsd"}, {"schedule": "steps", "warmup_steps": 5, "decay_steps": 5},
                {"schedule": "wsd", "warmup_steps": 0, "decay_steps": 5}):
        with pytest.raises(ValueError):
            FeatureDistillModule(**bad)


def test_a_chunk_of_another_run_is_refused(head_corpus, tmp_path, monkeypatch, shipped):
    monkeypatch.chdir(tmp_path)
    argv = config(tmp_path, head_corpus, {"session_steps": 2, "heldout_rows": 0})
    train(argv, monkeypatch, {})
    from training.draft.distill import main

    shutil.rmtree(tmp_path / "runs")
    for flag, value in (("--model.steps", "3"), ("--data.draft_vocab_size", "36")):
        with pytest.raises(SystemExit) as e:
            main(argv + [flag, value])
        assert e.value.code == 2
    with pytest.raises(C.ChunkError, match="another run"):
        C.check_identity(C.read_meta(tmp_path / "chunks" / "head" / "latest"),
                         {"target": {"name": "other"}}, "chunk")


def test_an_interrupted_write_leaves_the_old_chunk_whole(tmp_path, monkeypatch):
    import safetensors.torch as st

    ckpt = {"global_step": 3, "state_dict": {"w": torch.randn(64, 64)},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 64),
                                                "exp_avg_sq": torch.rand(64, 64)}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}]}
    out = tmp_path / "latest"
    C.write_chunk(out, ckpt, {"note": "old"}, shard_mib=0.01)
    assert len(list(out.glob("tensors-*.safetensors"))) >= 3  # several shards: the write can stop between
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    back, doc = C.read_chunk(out)
    assert torch.equal(back["state_dict"]["w"], ckpt["state_dict"]["w"]) and doc["note"] == "old"
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples, int keys come back
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg_sq"], ckpt["optimizer_states"][0]["state"][0]["exp_avg_sq"])

    real, calls = st.save_file, []

    def dies(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the machine goes away mid-write
        return real(*a, **kw)

    monkeypatch.setattr(st, "save_file", dies)
    ckpt["global_step"] = 9
    with pytest.raises(KeyboardInterrupt):
        C.write_chunk(out, ckpt, {"note": "new"}, shard_mib=0.01)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no half-written folder left
    monkeypatch.setattr(st, "save_file", real)
    # bfloat16 moments: a smaller chunk, the moments rounded
    C.write_chunk(out, ckpt, {}, moments="bfloat16")
    back, _ = C.read_chunk(out)
    m = back["optimizer_states"][0]["state"][0]["exp_avg"]
    assert m.dtype == torch.float32 and not torch.equal(m, ckpt["optimizer_states"][0]["state"][0]["exp_avg"])
    assert torch.equal(back["state_dict"]["w"], ckpt["state_dict"]["w"])  # weights stay fp32


def test_the_step_profile_splits_a_step_into_its_phases(head_corpus, tmp_path, monkeypatch, capsys):
    from training.head.profile import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "profile.json"
    main(config(tmp_path, head_corpus) + ["--data.source", "online", "--steps", "2", "--warmup", "1",
                                           "--json", str(out)])
    res = json.loads(out.read_text())
    assert {"data", "target", "head_fc", "head_step_1", "head_step_2", "loss", "backward", "optimizer"} <= set(res["ms"])
    assert res["ms"]["target"] > 0 and sum(res["share"].values()) == pytest.approx(1.0, abs=1e-6)
    assert "head_step_2" in capsys.readouterr().out
    assert not (tmp_path / "chunks").exists()  # a profile writes no chunk
