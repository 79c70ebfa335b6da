"""The lean forward (decoding.forward.lean): the same logits as transformers' layers to rounding,
on every architecture it takes; the others keep their layers (the kind says packed); greedy
decoding on it is HF's own, sliding windows included; the feature heads' hooks still see it."""

import copy

import pytest
import torch

from support.models import ARCHS, noisy_copy, tiny
from decoding.kv_cache import CachedModel
from decoding.drafts.capture import capture_aux
from decoding.forward.packed import forward_kind, packed_available, set_forward
from decoding.forward.lean import is_lean, why_not
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import TreeLayout, layout_from_k_config

LEAN = ["llama", "qwen2", "qwen2+window", "qwen3", "mistral+window"]
OTHERS = [a for a in ARCHS if a not in LEAN]


def _rounds(model, prompt=tuple(range(3, 14))):
    """Logits of a prefill + tree round, a commit, and the next round: what the engine feeds."""
    cm, lay = CachedModel(model), layout_from_k_config([2, 2])
    first = cm.feed(list(prompt), lay, [5, 6, 7, 8, 9, 10], 0, 6)[0]
    cm.commit([0, 2], 6)
    second = cm.feed(list(prompt) + [5, 7], lay, [1, 2, 3, 4, 5, 6], 0, 6)[0]
    return torch.cat([first, second])


@pytest.mark.parametrize("arch", LEAN)
def test_lean_logits_are_the_layers_logits(arch):
    eager = tiny(arch)
    lean = copy.deepcopy(eager)
    assert set_forward(lean, "lean") == "lean" == forward_kind(lean) and is_lean(lean)
    inner = lean.model.layers[0].self_attn.q_proj
    assert not hasattr(inner, "_packed_weight")  # one packed copy of a layer's weights, the fused one
    assert hasattr(lean.lm_head, "_packed_weight") == packed_available(torch.float32, "cpu")
    ref, got = _rounds(eager), _rounds(lean)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert (ref - got).abs().max() < 1e-4 * ref.abs().max()
    assert set_forward(lean, "eager") == "eager" and not is_lean(lean)
    assert torch.equal(_rounds(lean), ref)  # back to transformers' layers, bit for bit


@pytest.mark.parametrize("arch", OTHERS)
def test_other_layers_keep_transformers_forward(arch):
    model = tiny(arch)
    assert why_not(model.model.layers[0] if hasattr(model, "model") else model, model.config)
    kind = set_forward(model, "lean")
    assert kind == ("packed" if packed_available(torch.float32, "cpu") else "eager") and not is_lean(model)


@pytest.mark.parametrize("arch", LEAN)
def test_greedy_on_the_lean_forward_is_hf_generate(arch):
    """ar and a fixed fork on the lean forward reproduce HF's generate on the eager
    model (fp32), windows that bite included (the prompts are longer than the window)."""
    target = tiny(arch)
    draft = noisy_copy(target, 0.003)
    prompt, n = [1, 5, 7, 3, 9, 11, 2, 4, 8, 30], 16
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    for m in (target, draft):
        assert set_forward(m, "lean") == "lean"
    for cfg in (StrategyConfig(strategy="ar"), StrategyConfig(strategy="mcsd", k_config="3,2,1")):
        out, stats = build_engine(target, draft if cfg.strategy != "ar" else None, cfg,
                                  SamplingConfig()).generate(prompt, n)
        assert out == ref, f"{arch} / {cfg.name}"
        assert stats.lossless


def test_feature_hooks_and_hidden_states_see_the_lean_layers():
    eager = tiny("llama", num_hidden_layers=3)
    lean = copy.deepcopy(eager)
    set_forward(lean, "lean")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    got = []
    for m in (eager, lean):
        with torch.no_grad(), capture_aux(m, (0, 1, 2)) as cap:
            out = m(input_ids=ids, output_hidden_states=True)
        got.append((cap.aux(), torch.stack(out.hidden_states)))
    for a, b in zip(*got):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_bf16_rows_do_not_depend_on_how_many_rows_a_forward_carries():
    """A verify's first row in bf16 is the same row fed alone, up to rounding: the lean layer adds
    no row-count-dependent arithmetic (bit-identical on the AMX Xeon this was written on; oneDNN
    and sdpa may pick other kernels for few rows elsewhere, so only rounding is promised)."""
    if not packed_available(torch.bfloat16, "cpu"):
        pytest.skip("no packed bf16 here")
    model = tiny("llama").to(torch.bfloat16)
    set_forward(model, "lean")
    prompt = list(range(3, 14))
    cm = CachedModel(model)
    cm.feed(prompt[:-1], TreeLayout(()), [], 0, 0)
    one = cm.feed(prompt, TreeLayout(()), [], 0, 0)[0]
    cm.commit([], 0)
    cm2 = CachedModel(model)
    cm2.feed(prompt[:-1], TreeLayout(()), [], 0, 0)
    many = cm2.feed(prompt, layout_from_k_config([7]), list(range(20, 27)), 0, 7)[0]
    assert torch.equal(one[0].argmax(), many[0].argmax())
    assert (one[0] - many[0]).abs().max() <= 0.02 * one[0].abs().max()
