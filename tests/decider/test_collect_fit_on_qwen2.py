"""collect -> fit on a non-Llama pair: a tiny random Qwen2 target and a noisy copy of it as
the draft (in memory; prompts encoded character by character, as in test_trace_collection)."""

import copy
import json

import torch
from support.decider import StubSession
from support.decider import fit_config
from transformers import Qwen2Config, Qwen2ForCausalLM

from decoding.decider.policy import load_decider
from decoding.models import fingerprint
from training.decider import collect as C
from training.decider import fit
from training.corpus.teacher import Prompt


def qwen2_pair():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6)  # sharp: the draft is accepted often, not always
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, draft


def test_collect_then_fit_on_a_qwen2_pair(tmp_path):
    target, draft = qwen2_pair()
    prompts = [Prompt(f"p{i}", "general", "val", f"prompt {i} {'xy' * (i % 5)}") for i in range(24)]
    cfg = C.CollectConfig(out=str(tmp_path / "traces"), strategy="ti-mcsd", width=3, depth=4,
                          max_new_tokens=12, shard_size=8, dtype="float32")
    stats = C.collect(cfg, StubSession(target, draft), prompts, progress=False)
    assert stats["new_prompts"] == 24 and stats["rows"] > 0 and 0 < stats["acceptance_rate"] < 1
    manifest = json.loads((tmp_path / "traces" / "manifest.json").read_text())
    assert manifest["model_pair"]["target"] == fingerprint(target)
    rc = fit.main(["--config", str(fit_config(tmp_path, tmp_path / "traces")), "--export.run_id", "q2",
                   "--data.val_fraction", "0.25", "--data.test_fraction", "0.25"])
    assert rc == 0
    _, dcfg = load_decider(tmp_path / "deciders" / "q2", target, draft)  # refuses another pair
    assert dcfg.model_pair == manifest["model_pair"]
    metrics = json.loads((tmp_path / "deciders" / "q2" / "metrics.json").read_text())
    assert metrics["replay"]["test"]["oracle"]["tokens_per_s"] > 0
