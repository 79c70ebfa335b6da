"""The lossless proofs on a CUDA device (skipped without one): greedy equality with HF's own
`generate` on the GPU for every strategy and stop rule, sliding windows that bite included, and
the exact-sampling test with the engine's draws made on the GPU.

CPU CI never runs these; `pytest -m cuda tests/decoding/test_lossless_on_cuda.py` on a GPU machine
does. Greedy runs in float32 with TF32 matmuls off, so the GPU's sums are the only difference from
the CPU suite.
"""

from functools import cache

import pytest
import torch

from support.models import noisy_copy, tiny, tiny_llama
from support.arch_matrix import CASES, N, PROMPTS
from support.exact import SAMPLES, T1, WARPED, chi2_pvalue, exact_distribution, speculative_counts
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ARCHS = ["llama", "qwen3", "mistral+window", "gemma3+window", "gpt_neox"]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would turn fp32 greedy ties into noise
    torch.backends.cudnn.allow_tf32 = False


@cache
def models(arch):
    target = tiny(arch).to(DEV)
    return target, noisy_copy(target, 0.003)


@cache
def reference(arch, prompt):
    with torch.no_grad():
        out = models(arch)[0].generate(torch.tensor([prompt], device=DEV), max_new_tokens=N,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["ar", *CASES])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate_on_cuda(arch, case):
    target, draft = models(arch)
    if case == "ar":
        eng = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    else:
        cfg, make_stop = CASES[case]
        stop = make_stop(draft) if make_stop else None
        if stop is not None and hasattr(stop, "net"):
            stop.net.to(DEV)
        eng = build_engine(target, draft, cfg, SamplingConfig(), stop=stop)
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == reference(arch, tuple(prompt)), f"{arch} / {case}"
        assert stats.lossless and stats.new_tokens == N


SAMPLING = [("mcsd-2,2", StrategyConfig(strategy="mcsd", k_config="2,2"), T1),
            ("ti-mcsd+confidence-top-p", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence",
                                                        confidence_threshold=0.2), WARPED)]


@pytest.mark.parametrize("name,cfg,sampling", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_continuations_follow_target_on_cuda(name, cfg, sampling):
    target = tiny_llama(0, vocab=6, layers=1, hidden=16, scale=3).to(DEV)
    draft = tiny_llama(1, vocab=6, layers=1, hidden=16, scale=3).to(DEV)
    exact = exact_distribution(target.cpu(), sampling)  # the law, enumerated on the CPU
    target.to(DEV)
    counts, _, _ = speculative_counts(build_engine(target, draft, cfg, sampling), SAMPLES)
    pvalue = chi2_pvalue(counts, exact, SAMPLES)
    assert pvalue > 1e-3, f"{name}: p={pvalue:.2e}"
