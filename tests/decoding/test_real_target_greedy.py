"""Marked `real`: the embedded SmolLM2 target. Every strategy gives the same greedy output as
`ar` in the same dtype: bit for bit in fp32; in bf16 every difference must be a near-tie of the
target's logits flipped by rounding (decoding.bench.agreement), never a real mismatch."""

from pathlib import Path

import pytest
import torch

from decoding import models
from decoding.bench.agreement import check_greedy
from decoding.forward.cost import CostCurve
from decoding.growth import GrowPolicy, q_scores
from decoding.stopping.gate import DraftGate
from decoding.sampling import SamplingConfig
from decoding.models.session import Session
from decoding.strategies import StrategyConfig, build_engine

pytestmark = pytest.mark.real
PROMPTS = ["Write a Python function that adds two numbers.", "Name three colors of the rainbow."]
N = 32


def grow_policy(cfg):
    """The cost-aware tree over q, with the CPU's measured cost shape (decoding.growth), its gate
    held open: the gate scales prices by rounds timed on the wall, and a loaded machine's timings
    can shut it for the whole request, so that no deep path is taken (the gate's plain and drafted
    rounds mixed keep ar's text too: tests/decoding/test_draft_gate.py)."""
    cost = CostCurve([1, 5, 16, 45, 64], [36.6, 41.0, 42.0, 55.0, 59.0], [4.0, 4.2, 5.0, 6.0, 7.0])
    return GrowPolicy(q_scores, cost, max_width=cfg.width, max_nodes=cfg.max_nodes, gate=DraftGate.held_open())


STANDALONE = Path(__file__).resolve().parents[2] / "checkpoints" / "drafts" / "smollm2-135m-draft"


@pytest.mark.parametrize("dtype,draft_dir", [("float32", None), ("bfloat16", None), ("float32", STANDALONE)],
                         ids=["default-float32", "default-bfloat16", "standalone-float32"])
def test_strategies_agree_with_ar(dtype, draft_dir):
    sess = Session.open(None, draft_dir, dtype)
    # both shipped drafts (the default feature head; the stand-alone model HF's assisted
    # generation drives) are accepted on about 2/3 of these tokens, so deep tree paths are really
    # exercised (a 4-layer cut of the target was accepted 1-2 times in 32 tokens and ran 4x slower)
    draft = sess.draft
    assert draft is not None, "the default draft is missing from checkpoints/drafts"
    greedy = SamplingConfig()
    configs = [StrategyConfig(strategy="sd", gamma=4), StrategyConfig(strategy="mcsd", k_config="4,2,2,1"),
               StrategyConfig(strategy="ti-mcsd", width=4, depth=6),
               StrategyConfig(strategy="ti-mcsd", width=3, depth=8, stop="confidence"),
               StrategyConfig(strategy="ti-mcsd", width=4, depth=8, stop="confidence", confidence_rule="grow")]
    prompts = PROMPTS
    if dtype == "bfloat16":
        # fp32 proves every strategy bit for bit; bf16 asks only whether batched verification's
        # differences are all near-ties, which a chain and a tree answer. Emulated bf16 (a CPU
        # without AVX512-BF16 / AMX) runs several times slower than fp32, so one prompt.
        prompts, configs = PROMPTS[:1], [c for c in configs if c.name in ("sd[g=4]", "ti-mcsd[W=4,D=6]")]
        assert len(configs) == 2
    ar = build_engine(sess.target, None, StrategyConfig(strategy="ar"), greedy)
    for text in prompts:
        ids = sess.encode(text, chat=True)
        ref, _ = ar.generate(ids, N)
        for cfg in configs:
            stop = grow_policy(cfg) if cfg.confidence_rule == "grow" else None
            out, stats = build_engine(sess.target, draft, cfg, greedy, stop).generate(ids, N)
            if dtype == "float32":
                assert out == ref, cfg.name
            else:  # which near-ties a batched bf16 verification flips depends on the CPU
                check = check_greedy(sess.target, ids, ref, out, dtype)
                assert check.kind != "mismatch", (cfg.name, check)
            assert stats.accepted >= N // 4, (cfg.name, stats.accepted)  # deep paths were taken


def test_default_target_conversion_is_cached():
    d = models.default_target_dir()
    assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()
    tok = models.load_tokenizer(d)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_mismatched_tokenizer_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    sess = Session.open(None, None, "float32")
    other = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(models.ModelError, match="vocabularies differ"):
        models.check_pair(sess.target, other)
    torch.manual_seed(0)
