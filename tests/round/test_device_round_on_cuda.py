"""The device round captured as CUDA graphs (skipped without a CUDA device): greedy equality with
HF's own `generate` for every shape, exact sampling with the device's draws replayed by the graphs,
graphs captured ahead of a run, the cache growing while graphs exist, and one host read a round.
fp32 with TF32 off, as the other CUDA tests.

`python -m pytest -q -n 0 -m cuda tests/round/test_device_round_on_cuda.py` on a GPU machine.
"""

import copy
from functools import cache

import pytest
import torch

from support.exact import SAMPLES, T1, WARPED, chi2_pvalue, exact_distribution, speculative_counts
from support.head import GREEDY, N, PROMPTS, fit_head, tiny_feature_draft
from support.models import tiny_llama
from decoding.round.engine import RoundEngine
from decoding.round.shape import RoundShape

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"
SHAPES = [(), (1, 1, 1), (3, 2, 1), (4, 1, 1, 1)]


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@cache
def pair():
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(target)
    t = copy.deepcopy(target).to(DEV)
    h = copy.deepcopy(head).to(DEV)
    h.attach_embeddings(t.get_input_embeddings().weight)
    return t, h


@cache
def reference(prompt):
    target = pair()[0]
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt], device=DEV), max_new_tokens=N, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("ks", SHAPES, ids=lambda k: ",".join(map(str, k)) or "ar")
def test_greedy_equals_hf_generate_on_a_captured_round(ks):
    target, head = pair()
    eng = RoundEngine(target, head, RoundShape(ks), GREEDY)
    assert eng.capture
    accepted = 0
    for prompt in PROMPTS:
        out, st = eng.generate(prompt, N)
        assert out == reference(tuple(prompt))
        accepted += st.accepted
    assert eng.graphs  # the rounds replayed captured graphs
    assert not ks or accepted > 0


def test_precaptured_graphs_and_cache_growth_keep_the_text(monkeypatch):
    from decoding.round import runner

    target, head = pair()
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), GREEDY)
    assert eng.precapture(PROMPTS[0], 200) >= 2
    held = dict(eng.graphs)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == reference(tuple(prompt))
    assert all(eng.graphs[k] is g for k, g in held.items())  # replayed, not captured again
    monkeypatch.setattr(runner, "START_CAPACITY", 8)  # a cache that doubles while graphs exist
    eng = RoundEngine(target, head, RoundShape((2, 1, 1)), GREEDY)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == reference(tuple(prompt))
    assert eng.runner.sc.capacity > 8


def test_one_host_read_a_round():
    target, head = pair()
    eng = RoundEngine(target, head, RoundShape((1, 1, 1)), GREEDY)
    _, st = eng.generate(PROMPTS[0], N)
    assert eng.reads == st.rounds - 1  # every round but the prompt's: one read each


@pytest.mark.parametrize("ks,sampling", [((2, 2), T1), ((2, 1), WARPED)], ids=["tree", "top-p"])
def test_sampling_is_exact_with_device_draws(ks, sampling):
    target = tiny_llama(0, vocab=6, layers=2, hidden=16, scale=3)
    head = tiny_feature_draft(target, draft_vocab=4, aux=(0, 1, 1), seed=3)
    t = target.to(DEV)
    head = head.to(DEV)
    head.attach_embeddings(t.get_input_embeddings().weight)
    eng = RoundEngine(t, head, RoundShape(ks), sampling)
    counts, _, _ = speculative_counts(eng, SAMPLES)
    assert eng.graphs
    pvalue = chi2_pvalue(counts, exact_distribution(target.cpu(), sampling), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"
