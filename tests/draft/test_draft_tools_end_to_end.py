"""End to end, on tiny models: the tools a user runs (corpus, the shipped distill configs,
draft_cost, distill_eval; the demo is tests/ops/test_demo.py), each through its own `main` with the shipped config and only
the models, data and sizes overridden."""

import json
import shutil

import pytest
import yaml

from support.distill import ROOT

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def chat_target(target_dir, tmp_path_factory):
    """The tiny target with a chat template (the corpus tools encode prompts as chat)."""
    out = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(target_dir, out)
    cfg = out / "tokenizer_config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"chat_template": CHAT}))
    return out


def test_corpus_shipped_config_on_a_tiny_target(chat_target, tmp_path, capsys):
    from training.corpus import teacher as corpus

    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "kind": "general", "prompt": "abc"[: 1 + i % 3]})
                               + "\n" for i in range(6)))
    args = ["--config", str(ROOT / "configs/corpus.yaml"), "--target", str(chat_target),
            "--prompt-files", str(prompts), "--out", str(tmp_path / "c"), "--dtype", "float32",
            "--batch-size", "4", "--shard-size", "4", "--max-new-tokens", "6", "--threads", "1"]
    corpus.main(args)
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = corpus.load_corpus(tmp_path / "c").to_list()
    assert sorted(r["prompt_id"] for r in rows) == [f"p{i}" for i in range(6)]
    assert all(0 < len(r["completion_ids"]) <= 6 for r in rows) and stats
    corpus.main(args)  # a rerun resumes: nothing new, nothing duplicated
    assert len(corpus.load_corpus(tmp_path / "c").to_list()) == 6


def distill_args(config: str, target_dir, corpus_dir, on_policy_dir) -> list[str]:
    """The shipped config with the tiny target, corpora and a few steps; paths the config
    gives relative (runs/, checkpoints/) land in the test's working directory."""
    args = ["--config", str(ROOT / "configs" / config), "--model.target", str(target_dir),
            "--model.k", "8", "--data.k", "8", "--data.corpus", str(corpus_dir),
            "--data.teacher_cache", str(corpus_dir / "cache"), "--data.batch_size", "8",
            "--data.val_percent", "20", "--data.max_val_rows", "8", "--run.threads", "1",
            "--run.threads_file", "null", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    if yaml.safe_load((ROOT / "configs" / config).read_text())["model"]["draft"]["init"] == "new":
        args += ["--model.draft.layers", "1", "--model.draft.hidden", "32", "--model.draft.heads", "2",
                 "--model.draft.intermediate", "64", "--model.draft.head_size", "48"]
    else:  # the warm starts read the previous stage's export and the on-policy corpus
        args += ["--data.extra_corpora", json.dumps([str(on_policy_dir)]), "--data.extra_writers", "null"]
    return args


def test_shipped_distill_configs_chain_on_a_tiny_target(target_dir, corpus_dir, on_policy_dir,
                                                        tmp_path, monkeypatch):
    from decoding.models import load_model
    from training.draft import distill

    monkeypatch.chdir(tmp_path)
    names = []
    for config in ("distill_draft.yaml", "distill_draft_v2.yaml", "distill_draft_v3.yaml"):
        name = yaml.safe_load((ROOT / "configs" / config).read_text())["run"]["name"]
        distill.main(distill_args(config, target_dir, corpus_dir, on_policy_dir))
        out = tmp_path / "checkpoints" / "drafts" / name
        meta = json.loads((out / "specstop_draft.json").read_text())
        assert "val/agree" in meta["metrics"]["validation"], config
        assert (tmp_path / "runs" / "distill" / name / "version_0" / "metrics.csv").exists()
        names.append((name, load_model(out).config.num_hidden_layers))
    # v2 grows one layer over v1 (its config says so); v3 keeps v2's shape
    assert [n for _, n in names] == [1, 2, 2]


def test_draft_cost_and_distill_eval_on_a_tiny_pair(chat_target, tmp_path, capsys):
    from support.distill import TINY_DRAFT
    from training.bench import draft_cost
    from training.draft import evaluate as distill_eval
    from training.draft.distill import export_draft
    from training.draft.module import DistillModule

    draft = export_draft(DistillModule(draft=TINY_DRAFT, target=str(chat_target)), tmp_path / "d",
                         {"kind": "specstop-draft", "metrics": {}})
    draft_cost.main(["--target", str(chat_target), "--draft", str(draft), "--threads", "1",
                     "--dtype", "float32", "--repeats", "2", "--out", str(tmp_path / "cost.json")])
    cost = json.loads((tmp_path / "cost.json").read_text())["cost"]
    assert [r["threads"] for r in cost] == [1] and cost[0]["draft_step_ms"] > 0 < cost[0]["cost_ratio"]
    distill_eval.main(["--target", str(chat_target), "--draft", str(draft), "--out", str(tmp_path / "rep"),
                       "--prompts", "2", "--engine-prompts", "1", "--max-new-tokens", "8",
                       "--dtype", "float32", "--threads", "1", "--eval-cache", str(tmp_path / "ec")])
    res = json.loads((tmp_path / "rep" / "eval.json").read_text())
    for kind in ("general", "code"):
        tf = res["teacher_forced"][kind]
        assert tf["prompts"] == 2 and tf["positions"] > 0 and 0 <= tf["top1_agreement"] <= 1
        runs = res["engine"][kind]
        assert {"ar", "sd[g=4]"} <= set(runs)
        assert all(r["new_tokens"] == 8 and r["block_efficiency"] >= 1 for r in runs.values())
    assert "Draft evaluation" in (tmp_path / "rep" / "eval.md").read_text()
    # the draft carries its held-out figures
    assert json.loads((draft / "specstop_draft.json").read_text())["metrics"]["heldout"]["cost"]
