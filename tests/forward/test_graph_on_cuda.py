"""The graph forward (decoding.forward.static with CUDA graphs) on a CUDA device (skipped without
one): greedy equality with HF's own `generate` on the GPU for every strategy and stop rule on the
tiny architectures (sliding windows that bite included), a feature head reading the target
through the graphs' taps (its own steps eager or captured), the capture of every bucket ahead of a run, and the exact-sampling test
with the engine's draws on the GPU. fp32 with TF32 off, as tests/decoding/test_lossless_on_cuda.py.

`python -m pytest -q -n 0 -m cuda tests/forward/test_graph_on_cuda.py` on a GPU machine.
"""

import copy
from functools import cache

import pytest
import torch

from support.arch_matrix import CASES, N, PROMPTS
from support.exact import SAMPLES, T1, WARPED, chi2_pvalue, exact_distribution, speculative_counts
from support.head import fit_head
from support.models import noisy_copy, tiny, tiny_llama
from decoding.forward import static
from decoding.forward.packed import set_forward
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ARCHS = ["llama", "qwen3", "mistral+window", "gemma3+window", "gpt_neox"]
DEV = "cuda"
GREEDY = SamplingConfig()


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would turn fp32 greedy ties into noise
    torch.backends.cudnn.allow_tf32 = False


def graphed(*ms):
    out = tuple(copy.deepcopy(m).to(DEV) for m in ms)
    for m in out:
        assert set_forward(m, "graph") == "graph"
    return out


@cache
def models(arch):
    target = tiny(arch)
    return graphed(target, noisy_copy(target, 0.003))


@cache
def reference(arch, prompt):
    target = models(arch)[0]
    with torch.no_grad():  # HF's own generate, its own dynamic cache, eager
        out = target.generate(torch.tensor([prompt], device=DEV), max_new_tokens=N, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["ar", *CASES])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate_on_graphs(arch, case):
    target, draft = models(arch)
    if case == "ar":
        eng = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    else:
        cfg, make_stop = CASES[case]
        stop = make_stop(draft) if make_stop else None
        if stop is not None and hasattr(stop, "net"):
            stop.net.to(DEV)
        eng = build_engine(target, draft, cfg, GREEDY, stop=stop)
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == reference(arch, tuple(prompt)), f"{arch} / {case}"
        assert stats.lossless and stats.new_tokens == N
    assert eng.target.capture and eng.target.graphs  # the rounds replayed captured graphs


def test_precaptured_graphs_give_the_same_output():
    target, draft = models("llama")
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=5)
    want = build_engine(target, draft, cfg, GREEDY).generate(PROMPTS[0], N)[0]
    eng = build_engine(target, draft, cfg, GREEDY)
    n = eng.target.precapture(256)
    assert n == len(static.BUCKETS) * 2  # columns 128 and 256
    assert eng.generate(PROMPTS[0], N)[0] == want and len(eng.target.graphs) == n


@pytest.mark.parametrize("head_forward", ["eager", "graph"])
def test_feature_head_reads_the_target_through_graph_taps(head_forward):
    """The head's steps eager, or captured too (decoding.drafts.head_graph)."""
    base = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(base)
    (target,) = graphed(base)
    head.to(DEV)
    head.attach_embeddings(target.get_input_embeddings().weight)
    set_forward(head, head_forward)
    ref = build_engine(base.to(DEV), None, StrategyConfig(strategy="ar"), GREEDY)
    accepted = 0
    for cfg in (StrategyConfig(strategy="mcsd", k_config="3,2,1"), StrategyConfig(strategy="ti-mcsd", width=3, depth=4)):
        eng = build_engine(target, head, cfg, GREEDY)
        for prompt in ([1, 2, 3], [7, 7, 7, 7, 9, 11]):
            out, stats = eng.generate(prompt, 24)
            assert out == ref.generate(prompt, 24)[0]
            accepted += stats.accepted
        assert eng.target.graphs and eng.target.tap_hooks
        assert bool(getattr(eng.proposer.model.cache, "graphs", None)) == (head_forward == "graph")
    assert accepted > 0


SAMPLING = [("mcsd-2,2", StrategyConfig(strategy="mcsd", k_config="2,2"), T1),
            ("ti-mcsd+confidence-top-p", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence",
                                                        confidence_threshold=0.2), WARPED)]


@pytest.mark.parametrize("name,cfg,sampling", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_continuations_follow_target_on_graphs(name, cfg, sampling):
    target = tiny_llama(0, vocab=6, layers=1, hidden=16, scale=3)
    draft = tiny_llama(1, vocab=6, layers=1, hidden=16, scale=3)
    exact = exact_distribution(target, sampling)  # the law, enumerated on the CPU
    counts, _, _ = speculative_counts(build_engine(*graphed(target, draft), cfg, sampling), SAMPLES)
    pvalue = chi2_pvalue(counts, exact, SAMPLES)
    assert pvalue > 1e-3, f"{name}: p={pvalue:.2e}"
