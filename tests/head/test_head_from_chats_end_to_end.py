"""docs/chat-data.md end to end on a tiny chat target: chat file -> regenerated corpus ->
feature head trained with the shipped chat config -> acceptance by context position."""

from __future__ import annotations

import json

from support.chat import make_chat_target, openai_rows, sharegpt_rows, write_jsonl
from support.distill import ROOT


def test_three_commands_train_a_head_on_your_own_chats(tmp_path, monkeypatch, capsys):
    from training.draft.distill import main as distill
    from training.corpus import chat as chat_corpus
    from training.bench import positions
    from training.corpus.teacher import load_corpus

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    target = str(make_chat_target(tmp_path / "target"))
    chats = write_jsonl(tmp_path / "my_chats.jsonl", sharegpt_rows(24, turns=2) + openai_rows(8))

    # 1. regenerate the assistant turns with the target
    chat_corpus.main(["--config", str(ROOT / "configs/chat_corpus.yaml"), "--data", str(chats),
                      "--target", target, "--dtype", "float32", "--max-new-tokens", "16",
                      "--batch-size", "8", "--val-percent", "20", "--heldout-percent", "10"])
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = load_corpus("data/corpus-chat").to_list()
    assert stats["total_rows"] == len(rows) > 32 and any(r["prompt_id"].endswith("@1") for r in rows)

    tiny = ["--model.target", target, "--model.steps", "2", "--model.schedule", "steps",
            "--data.target", target, "--data.draft_vocab_size", "60", "--data.k", "8",
            "--data.layers", "[0, 1, 3]", "--data.val_percent", "20", "--data.max_val_rows", "16",
            "--data.source", "online", "--run.threads", "1", "--trainer.max_time", "null",
            "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
            "--trainer.enable_progress_bar", "false"]
    base = ["--config", str(ROOT / "configs/distill_eagle3.yaml")]
    # (the shipped head the chat config starts from: here a tiny one trained on the chats)
    distill(base + tiny + ["--data.corpora", '["data/corpus-chat"]'])
    # 2. train the head on them (the chat config over the base recipe)
    distill(base + ["--config", str(ROOT / "configs/distill_eagle3_chat.yaml")] + tiny
            + ["--data.corpora", '["data/corpus-chat"]', "--model.loss", "lk_lambda"])
    head = tmp_path / "runs" / "drafts" / "smollm2-135m-eagle3-chat"
    meta = json.loads((head / "specstop_draft.json").read_text())
    longest = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    assert 0 < meta["training"]["trained_window"] <= longest
    assert meta["training"]["loss"] == "lk_lambda"
    import csv

    logged = list(csv.DictReader(open(tmp_path / "runs/distill/smollm2-135m-eagle3-chat/version_0/metrics.csv")))
    accept = [float(r["val/accept_1"]) for r in logged if r.get("val/accept_1")]
    assert accept and all(0 < a <= 1 for a in accept)

    # 3. how it accepts, by context position, on your validation conversations
    positions.main(["--draft", str(head), "--corpus", "data/corpus-chat", "--target", target,
                         "--val-percent", "20", "--edges", "0", "64", "128", "--out", "rep"])
    rep = json.loads((tmp_path / "rep" / "positions.json").read_text())
    assert [b["from"] for b in rep["buckets"]] == [0, 64, 128]
    val = [r for r in rows if r["split"] == "val"]
    assert sum(b["positions"] for b in rep["buckets"]) == sum(len(r["completion_ids"]) for r in val)
