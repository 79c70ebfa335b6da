"""A float16 KV cache (decoding.kv_cache.set_kv_dtype) under a float32 model.

The attention kernels read float16 keys and values as exactly the float32 numbers they hold; the
one-call layers store them with the rounding of the per-op layer; and the model's law under it is
kept by speculation: greedy equals `ar` on the same cache type, a request's rows in a batched
round equal its batch-1 rows bit for bit, and sampled continuations follow the law of the target
with that cache, enumerated exactly.
"""

import copy
import itertools

import pytest
import torch

from decoding.batch.forward import Segment, verify_many
from decoding.forward import kernels, quant
from decoding.forward.packed import set_forward
from decoding.kv_cache import CachedModel, kv_dtype, new_cache, set_kv_dtype
from decoding.sampling import SamplingConfig, warp
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from support.exact import LENGTH, PROMPT, SAMPLES, VOCAB, WARPED, chi2_pvalue, speculative_counts
from support.models import tiny_llama

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="decoding.forward.kernels not built here")


def attention_ops():
    """The row attentions that read a float16 cache: the AVX512 kernels', the quantized library's (AVX2)."""
    out = []
    if kernels.available():
        out.append(pytest.param(lambda *a: kernels.ops.row_attention(*a), id="kernels"))
    if quant.available():
        out.append(pytest.param(lambda *a: quant.row_attention(*a), id="avx2"))
    return out or [pytest.param(None, marks=pytest.mark.skip(reason="no attention kernel builds here"))]


@pytest.mark.parametrize("attend", attention_ops())
@pytest.mark.parametrize("T, D", [(1, 64), (5, 64), (12, 64), (1, 48), (7, 48)])
def test_float16_keys_are_read_as_the_numbers_they_hold(attend, T, D):
    """Every path of the kernels (a step's keys-as-lanes scores, the chain past 16 lanes, values
    read in place or padded): float16 k / v give the bits of float32 k / v holding the same values."""
    g = torch.Generator().manual_seed(T * 100 + D)
    N = 37 + T  # a tail past the blocks of 16 keys
    q = torch.randn(1, 9, T, D, generator=g)
    k, v = (torch.randn(1, 3, N, D, generator=g).half() for _ in range(2))
    seen = torch.rand(1, 1, T, N, generator=g) < 0.7
    seen[..., 0] = True
    mask = torch.zeros(1, 1, T, N).masked_fill(~seen, float("-inf")) if T > 1 else None
    got = attend(q, k, v, mask, D ** -0.5)
    want = attend(q, k.float(), v.float(), mask, D ** -0.5)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_bad_kv_dtypes_are_refused(pair):
    eager = copy.deepcopy(pair[0])
    with pytest.raises(ValueError, match="lean forward"):
        set_kv_dtype(eager, "float16")
    with pytest.raises(ValueError, match="float32, float16"):
        set_kv_dtype(eager, "int8")
    set_kv_dtype(eager, "float32")  # the model's own: always fine
    assert CachedModel(eager).cache.layers[0].kv_dtype is None


@needs_kernel
def test_another_forward_drops_the_float16_cache(pair):
    """set_forward re-makes the layers: the cache goes back to the model's dtype (eager attention
    would get float16 keys under float32 queries otherwise)."""
    m = copy.deepcopy(pair[0])
    assert set_forward(m, "lean") == "lean"
    set_kv_dtype(m, "float16")
    assert kv_dtype(m) == torch.float16 and CachedModel(m).cache.layers[0].kv_dtype == torch.float16
    assert set_forward(m, "eager") == "eager"
    assert kv_dtype(m) is None and CachedModel(m).cache.layers[0].kv_dtype is None


@pytest.fixture(scope="module")
def lean16(pair):
    """The conftest pair on the lean forward, the target's KV cache float16."""
    out = tuple(copy.deepcopy(m) for m in pair)
    for m in out:
        assert set_forward(m, "lean") == "lean"
    set_kv_dtype(out[0], "float16")
    return out


@needs_kernel
def test_greedy_speculation_equals_ar_on_a_float16_cache(lean16):
    target, draft = lean16
    ar = build_engine(target, None, StrategyConfig("ar"), SamplingConfig())
    prompt = [1, 5, 7, 3, 9, 2]
    want, _ = ar.generate(prompt, 24)
    for cfg in (StrategyConfig("mcsd", k_config="3,2,1"), StrategyConfig("ti-mcsd", width=3, depth=4)):
        out, _ = build_engine(target, draft, cfg, SamplingConfig()).generate(prompt, 24)
        assert out == want
    c = CachedModel(target)
    c.feed(prompt, layout_from_k_config((2, 1)), [4, 6, 8], 0, 3)
    assert all(layer.keys.dtype == torch.float16 for layer in c.cache.layers)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_batch1_rows_on_a_float16_cache(lean16, threads):
    """Three requests, three rounds of trees: the one-call layer's rows (keys stored by its own
    conversion) equal each request's own feed (the per-op layer's prompt, torch's conversion)."""
    target = lean16[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompts = [[1, 5, 7, 3], [2], [9, 9, 4, 4, 11, 30, 17]]
        solo, batched = [CachedModel(target) for _ in prompts], [CachedModel(target) for _ in prompts]
        lay = layout_from_k_config((2, 2))
        for r in range(3):
            toks = [[(7 * r + 3 * i + j) % 32 for j in range(lay.size)] for i in range(len(prompts))]
            want = [c.feed(p, lay, t, 0, lay.size)[0] for c, p, t in zip(solo, prompts, toks)]
            got = verify_many(target, [Segment(c, list(p), lay, t) for c, p, t in zip(batched, prompts, toks)])
            assert all(torch.equal(w, x) for w, x in zip(want, got))
            path = lay.path_to(r % lay.size)
            for c1, c2, p, t in zip(solo, batched, prompts, toks):
                c1.commit(path, lay.size)
                c2.commit(path, lay.size)
                p += [t[i] for i in path] + [r + 1]
    finally:
        torch.set_num_threads(before)


def exact_distribution_on_cache(target, sampling):
    """P(x1..xL | prompt) of every continuation under the target with its own KV cache (float16
    here), from one batched forward through it."""
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])
    with torch.no_grad():
        logits = target(ids, past_key_values=new_cache(target), use_cache=True).logits[:, len(PROMPT) - 1: -1]
    probs = warp(logits, sampling)
    seq_p = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0].double().prod(-1)
    return dict(zip(seqs, seq_p.tolist()))


@needs_kernel
def test_sampled_continuations_follow_the_float16_cache_law():
    target = tiny_llama(0, vocab=VOCAB, layers=1, hidden=16, scale=3)
    draft = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16, scale=3)
    for m in (target, draft):
        assert set_forward(m, "lean") == "lean"
    set_kv_dtype(target, "float16")
    cfg = StrategyConfig("ti-mcsd", width=2, depth=2, stop="confidence", confidence_threshold=0.2)
    counts, _, _ = speculative_counts(build_engine(target, draft, cfg, WARPED), SAMPLES)
    exact = exact_distribution_on_cache(target, WARPED)
    assert chi2_pvalue(counts, exact, SAMPLES) > 1e-3
