"""Real vLLM (opt-in: SPECSTOP_VLLM_TESTS=1 and .venv-vllm from `make serve-check`; minutes):
a full-vocabulary head and a head on other aux layers, exported against a tiny random Llama,
load in vLLM and serve as specstop does (fp32 tokens, accepted draft tokens per prompt)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.distill import tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.drafts.io import save_feature_draft
from decoding.models import load_model
from training.export.check import VLLM_PYTHON, CheckConfig, check

PYTHON = os.environ.get("SPECSTOP_VLLM_PYTHON", VLLM_PYTHON)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("SPECSTOP_VLLM_TESTS") != "1" or not Path(PYTHON).is_file(),
    reason="opt-in: SPECSTOP_VLLM_TESTS=1 with vLLM's venv (make serve-check)")]
LAYERS = 8  # default aux layers 2, 4, 5: distinct (vLLM captures each layer once)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "target"
    torch.manual_seed(0)  # head_dim 64: a size vLLM's CPU attention supports
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # sharp: greedy far from ties
        for layer in model.model.layers[4:]:  # the output is the residual at layer 4's input:
            layer.self_attn.o_proj.weight.zero_()  # a head reading the aux layers can predict it
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out)
    tiny_tokenizer(out)
    return out


@pytest.mark.parametrize("vocab,aux", [(64, None), (48, (1, 2, 4))], ids=["full-vocab", "aux-1-2-4"])
def test_vllm_serves_the_exported_head_as_specstop(target, tmp_path, vocab, aux):
    t = load_model(target)
    torch.manual_seed(1)
    cfg = FeatureDraftConfig.from_target(t.config, draft_vocab_size=vocab, aux_layers=aux)
    used = torch.cat([torch.tensor([0, 1, 2]), 3 + torch.randperm(61)[:vocab - 3]])
    head = FeatureDraft(cfg).init_from_target(t, used)  # fc passes the highest aux layer through
    save_feature_draft(head, tmp_path / "head", t)
    rows = [{"id": f"p{i}", "kind": "general", "ids": [1] + [3 + (7 * i + 3 * j) % 60 for j in range(20)]}
            for i in range(4)]
    cfg = CheckConfig(python=PYTHON, draft=str(tmp_path / "head"), target=str(target), max_new_tokens=32,
                      contract_only=True)
    result = check(cfg, tmp_path / "report", rows=rows)
    assert result["contract"]["ok"], result["contract"]["failures"]
    assert sum(p["specstop_accepted"] for p in result["accepted_per_prompt"]) > 0  # the head matters
