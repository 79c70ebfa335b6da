"""A GGUF target at its own precision (decoding.forward.quant, csrc/quant*.cpp): with float32 activations
the kernel multiplies by exactly the dequantized weights; with q8 activations it computes the
int8-per-block law (checked against a float64 emulation); in both a row's result never depends
on the other rows or the instruction set; and every lossless strategy stays lossless on the
quantized forward (greedy equality with `ar` on the same weights, exact sampling). The GGUF reader
that maps a file's blocks to their modules: tests/forward/test_gguf_reader.py."""

import copy

import numpy as np
import pytest
import torch

from support.models import noisy_copy, tiny_llama
from decoding.forward import cpu, kernels
from decoding.forward import kquants, quant
from decoding.forward.packed import set_forward
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

pytestmark = pytest.mark.skipif(not quant.available(), reason=f"quantized kernel: {quant.why_not()}")
KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")  # the last three re-laid (decoding.forward.kquants)
AVX512 = "avx512_vnni" in cpu.flags()
ISAS = [1, 2] if AVX512 else [1]


def _weight(kind, n=80, k=None, seed=0, act="f32"):
    """K = 576 (SmolLM2's hidden size), 768 for a K-quant (whole super-blocks of 256)."""
    k = k or (768 if kind in kquants.QUANTIZERS else 576)
    torch.manual_seed(seed)
    w = quant.quantize(torch.randn(n, k), kind)
    w.act = act
    return w


def q8_emulation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 x_q @ w.T, x_q the rows of x quantized to int8 per block of 32 (scale max|x| / 127,
    round to even), as csrc/quant_q8.cpp does."""
    T, K = x.shape
    xb = x.view(T, K // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q.double() * dx.double()).view(T, K) @ w.double().T


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weights_are_gguf_s_own(kind):
    """The kernels' weights are exactly gguf's dequantization of the file's blocks, re-laid or not."""
    import gguf

    torch.manual_seed(0)
    w = torch.randn(48, 768) * torch.rand(48, 1) * 3  # rows of other scales
    if kind in kquants.QUANTIZERS:
        raw = kquants.QUANTIZERS[kind](w.numpy())
    else:
        raw = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    qw = quant.quantize(w, kind)
    assert torch.equal(qw.dequant(), ref)
    assert (ref - w).abs().max() < {"Q8_0": 0.02, "Q6_K": 0.1}.get(kind, 0.4) * w.abs().max()  # a real quantization
    if kind in kquants.RELAID:  # a Q5_0 / K-quant tensor costs the re-laid block sizes
        assert qw.w.shape[1] == 768 // 32 * quant.BLOCK_BYTES[qw.kind]


def test_k_quant_needs_whole_super_blocks():
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kquants.relay(np.zeros((16, 576 // 256 * 144), np.uint8), "Q4_K", 576)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_is_the_dequantized_product(kind, isa):
    """Up to fp32 summation error (K = 576 / 768, unit-scale inputs), on both code paths."""
    qw = _weight(kind)
    qw.isa = isa
    x, b = torch.randn(40, qw.k), torch.randn(80)
    ref = x.double() @ qw.dequant().double().T + b.double()
    assert (qw(x, b).double() - ref).abs().max() < 1e-3


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_q8_kernel_is_the_quantized_activation_law(kind, isa):
    qw = _weight(kind, act="q8")
    qw.isa = isa
    x, b = torch.randn(13, qw.k), torch.randn(80)
    assert (qw(x, b).double() - q8_emulation(x, qw.dequant()) - b.double()).abs().max() < 1e-3


@pytest.mark.parametrize("act", quant.ACTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_the_others(kind, isa, act):
    """Every row count (the direct path, the buffered one, several row groups) and one row at a
    time give the same bits: a verify row equals a 1-token step."""
    qw = _weight(kind, n=48, act=act)
    qw.isa = isa
    x, b = torch.randn(37, qw.k), torch.randn(48)
    full = qw(x, b)
    assert all(torch.equal(qw(x[:t], b), full[:t]) for t in range(1, 37))
    assert torch.equal(torch.cat([qw(x[i:i + 1], b) for i in range(37)]), full)


@pytest.mark.parametrize("act", quant.ACTS)
@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_outputs_not_sums(isa, act):
    """The kernels run their output panels on OpenMP threads (a weight's bytes x rows past a
    threshold): the bits are those of one thread, at every row count, split or not."""
    qw = _weight("Q4_1", n=512, act=act)
    qw.isa = isa
    x, b = torch.randn(17, 576), torch.randn(512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [qw(x[:t], b) for t in (1, 2, 5, 17)]
        torch.set_num_threads(2)
        two = [qw(x[:t], b) for t in (1, 2, 5, 17)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, c) for a, c in zip(one, two))
    assert all(torch.equal(a, one[-1][:a.shape[0]]) for a in one)


@pytest.mark.skipif(not AVX512, reason="needs an AVX512 CPU to compare both paths")
@pytest.mark.parametrize("act", quant.ACTS)
@pytest.mark.parametrize("kind", KINDS)
def test_avx2_and_avx512_agree_bit_for_bit(kind, act):
    qw = _weight(kind, act=act)
    x = torch.randn(9, qw.k)
    qw.isa = 1
    a = qw(x)
    qw.isa = 2
    assert torch.equal(a, qw(x))


@pytest.mark.skipif(not kernels.available(), reason="fp32 panels need decoding.forward.kernels")
def test_same_chain_as_the_fp32_panels():
    """One FMA chain per output, k in order: the fp32 panels over the dequantized weights agree."""
    qw = _weight("Q4_1")
    x, b = torch.randn(8, 576), torch.randn(80)
    dense = torch.ops.specstop.panel_linear(x, torch.ops.specstop.panel_pack(qw.dequant()), 80, b)
    assert torch.equal(qw(x, b), dense)


def test_isa_and_act_envs(monkeypatch):
    monkeypatch.setenv(quant.ISA_ENV, "avx2")
    monkeypatch.setenv(quant.ACT_ENV, "f32")
    w = quant.quantize(torch.randn(16, 32), "Q8_0")
    assert (w.isa, w.act) == (1, "f32")
    monkeypatch.setenv(quant.ACT_ENV, "q4")
    with pytest.raises(ValueError, match=quant.ACT_ENV):
        quant.quantize(torch.randn(16, 32), "Q8_0")
    monkeypatch.setenv(quant.ISA_ENV, "sse")
    with pytest.raises(ValueError, match=quant.ISA_ENV):
        quant.quantize(torch.randn(16, 32), "Q8_0")


def quantized_pair(kind="Q4_1", scale=6, vocab=32):
    """A tiny target whose linears fit the kernel (hidden 32, MLP 64; a K-quant: hidden 128, MLP
    256, so the down projection takes the K-quant and the rest Q5_0, as in a Q4_K_M file),
    quantized; its draft a noisy dense copy of the quantized target."""
    target = tiny_llama(0, vocab=vocab, hidden=128 if kind in kquants.QUANTIZERS else 32, scale=scale)
    assert quant.quantize_model(target, kind) >= 14  # 2 layers x 7 (+ the output layer at vocab 32)
    draft = noisy_copy(target, 0.03)
    for m in draft.modules():
        m.__dict__.pop("_quant", None)
    draft.__dict__.pop("_specstop_quant", None)
    return target, draft


GREEDY = SamplingConfig()
LOSSLESS = [
    StrategyConfig(strategy="sd", gamma=4),
    StrategyConfig(strategy="mcsd", k_config="4,2,2,1"),
    StrategyConfig(strategy="ti-mcsd", width=3, depth=5),
    StrategyConfig(strategy="ti-mcsd", width=4, depth=6, stop="confidence"),
]


# the packed forward attends with torch's attention: q8 there is no default and not proven
@pytest.mark.parametrize("forward,act", [("lean", "q8"), ("lean", "f32"), ("packed", "f32")])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_equals_quantized_ar(kind, forward, act, monkeypatch):
    monkeypatch.setenv(quant.ACT_ENV, act)
    target, draft = quantized_pair(kind)
    assert set_forward(target, forward) == forward and set_forward(draft, forward) == forward
    lins = [layer._lean[k].few for layer in target.model.layers for k in ("qkv", "o", "gate_up", "down")] \
        if forward == "lean" else [m._few for m in target.model.modules() if hasattr(m, "_few")]
    assert lins and all(isinstance(w, quant.QuantWeight) for w in lins)  # the blocks really run
    assert all(w.act == act for w in lins)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for cfg in LOSSLESS:
        eng = build_engine(target, draft, cfg, GREEDY)
        for prompt in ([1, 5, 7, 3], [9, 9, 9, 4, 4, 4, 11, 30, 17]):
            ref = ar.generate(prompt, 40)[0]
            out, stats = eng.generate(prompt, 40)
            assert out == ref, cfg.name
            assert stats.lossless


def test_quantized_ar_tracks_the_dequantized_model(monkeypatch):
    """With float32 activations the quantized forward is the dequantized model up to summation
    order."""
    monkeypatch.setenv(quant.ACT_ENV, "f32")
    target, _ = quantized_pair()
    fast = copy.deepcopy(target)
    set_forward(fast, "lean")
    for prompt in ([1, 5, 7, 3], [2]):
        with torch.no_grad():
            a = target(torch.tensor([prompt])).logits
            b = fast(torch.tensor([prompt])).logits
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("name,cfg,sampling,act,kind", [  # q8 on both ISA paths, and f32
    ("ti-mcsd+confidence-top-p", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence",
                                                confidence_threshold=0.2), SamplingConfig(temperature=0.8, top_p=0.9), "q8", "Q4_1"),
    ("mcsd-without-replacement", StrategyConfig(strategy="mcsd", k_config="2,2"), SamplingConfig(temperature=1.0), "f32", "Q4_1"),
    ("mcsd-without-replacement-no-avx512-kernels", StrategyConfig(strategy="mcsd", k_config="2,2"),
     SamplingConfig(temperature=1.0), "q8", "Q4_1"),
    ("sd-on-k-quants", StrategyConfig(strategy="sd", gamma=3), SamplingConfig(temperature=1.0), "q8", "Q4_K"),
])
def test_sampling_follows_the_quantized_target(name, cfg, sampling, act, kind, monkeypatch):
    """Exact sampling on the quantized lean forward: short continuations against the target's
    law enumerated over a 6-token vocabulary (the output layer stays dense: 6 < 16 outputs), the
    law computed by the quantized forward itself (one batched forward: rows are independent)."""
    from support.exact import LENGTH, SAMPLES, chi2_pvalue, exact_distribution, speculative_counts

    monkeypatch.setenv(quant.ACT_ENV, act)
    hidden = 256 if kind in kquants.QUANTIZERS else 32  # K-quants take whole super-blocks
    target = tiny_llama(0, vocab=6, layers=1, hidden=hidden, scale=3)
    draft = tiny_llama(1, vocab=6, layers=1, hidden=hidden, scale=3)
    assert quant.quantize_model(target, kind) == 7
    kernels = not name.endswith("no-avx512-kernels")  # as on an AVX2-only CPU: the AVX2 row attention
    set_forward(target, "lean", kernels=kernels)
    set_forward(draft, "lean", kernels=kernels)
    exact = exact_distribution(target, sampling)
    counts, _, _ = speculative_counts(build_engine(target, draft, cfg, sampling), SAMPLES)
    assert LENGTH == 3 and chi2_pvalue(counts, exact, SAMPLES) > 1e-3


@pytest.mark.skipif(not kernels.available(), reason="the one-call layer needs decoding.forward.kernels")
@pytest.mark.parametrize("act", quant.ACTS)
@pytest.mark.parametrize("avx512_kernels", [True, False])
def test_one_call_layer_on_blocks_equals_the_per_op_layer(act, avx512_kernels, monkeypatch):
    """`specstop::decoder_layer` over a GGUF's blocks (or, without the AVX512 kernels, as on an
    AVX2-only CPU, `specstop_quant::decoder_layer`, csrc/quant_layer.cpp): logits and KV cache equal
    the per-op layer's bit for bit over a prefill, a step, tree rounds and a commit."""
    from support.forward import layer_rounds

    if avx512_kernels and not kernels.available():
        pytest.skip("decoding.forward.kernels is not built here")
    monkeypatch.setenv(quant.ACT_ENV, act)
    runs = []
    for one_call in (True, False):
        m = tiny_llama(0, vocab=32, hidden=32, scale=6)
        quant.quantize_model(m, "Q4_1")
        set_forward(m, "lean", kernels=avx512_kernels)
        for layer in m.model.layers:
            assert layer._lean["ops"] is (kernels.ops if avx512_kernels else quant.ops)
            assert layer._lean["one_call"] > 1
            if not one_call:
                layer._lean["one_call"] = 0
        runs.append(layer_rounds(m))
    (a, ak), (b, bk) = runs
    for x, y in zip(a + ak, b + bk):
        assert torch.equal(x, y)


def test_feature_head_on_blocks_beside_a_quantized_target():
    """A GGUF target's feature head runs on Q8_0 blocks (decoding.forward.quant.quantize_head): its lean
    step multiplies by them, its fingerprint stays the checkpoint's, and speculation with it still
    reproduces the quantized target's ar token for token."""
    from support.head import fit_head

    from decoding.models.fingerprint import fingerprint

    target = tiny_llama(0, vocab=48, layers=4, hidden=32, scale=6)
    head = fit_head(target, draft_vocab=32, steps=60)  # fitted on the dense target, as a shipped head
    quant.quantize_model(target, "Q4_1")
    before = fingerprint(head)["weights_sha256"]
    assert quant.quantize_head(head) >= 6 and fingerprint(head)["weights_sha256"] == before
    set_forward(target, "lean")
    set_forward(head, "lean")
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    eng = build_engine(target, head, StrategyConfig(strategy="ti-mcsd", width=3, depth=4), GREEDY)
    accepted = 0
    for prompt in ([1, 5, 7, 3], [9, 9, 9, 4, 4, 4, 11, 30, 17]):
        out, stats = eng.generate(prompt, 32)
        assert out == ar.generate(prompt, 32)[0]
        accepted += stats.accepted
    assert accepted > 0
    if kernels.batch_invariant():  # the lean step runs (on blocks) where the kernels are built
        assert isinstance(head._lean_step.qkv, quant.QuantWeight)


def test_avx2_row_attention_is_sdpa_row_by_row():
    """csrc/quant_attention.cpp (the lean layers' attention of a GGUF target without the AVX512
    kernels): torch's attention to fp32 rounding, GQA, bool and additive masks; and a row alone
    (a step: its visible keys only, no mask) gives the same bits as inside a verify."""
    torch.manual_seed(0)
    B, H, KV, T, S, D = 2, 6, 2, 5, 19, 64
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    vis = torch.ones(T, S, dtype=torch.bool)
    vis[:, S - T:] = torch.rand(T, T) < 0.5  # a tree's ancestors among the new rows
    vis[:, S - T:] |= torch.eye(T, dtype=torch.bool)
    for mask in (vis[None, None], torch.zeros(T, S).masked_fill(~vis, torch.finfo(torch.float32).min)[None, None]):
        out = quant.row_attention(q, k, v, mask, D ** -0.5)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(H // KV, 1),
                                                               v.repeat_interleave(H // KV, 1),
                                                               attn_mask=vis[None, None], scale=D ** -0.5)
        assert (out - ref.transpose(1, 2)).abs().max() < 1e-5
        for t in range(T):
            keys = vis[t].nonzero()[:, 0]
            alone = quant.row_attention(q[:, :, t:t + 1], k[:, :, keys], v[:, :, keys], None, D ** -0.5)
            assert torch.equal(alone[:, 0], out[:, t])


@pytest.mark.parametrize("T, D, N, tree", [(1, 64, 45, False), (5, 48, 37, False), (20, 36, 29, True),
                                           (70, 64, 0, False), (24, 128, 17, True)])
def test_avx2_row_attention_a_row_depends_on_its_visible_keys_only(T, D, N, tree):
    """Every path of csrc/quant_attention.cpp (a task of 16 query lanes with the rows as lanes, of up
    to 8 with 8 keys as lanes, a head dimension of whole vectors or not, a prompt's causal block
    where a task stops at its rows' last key, tasks across threads): row t inside the call equals
    the row alone over the keys it sees (a plain step), bit for bit, on 1 and 2 threads; and both
    match float64 attention to float32 rounding."""
    g = torch.Generator().manual_seed(T + D)
    H, KV = 9, 3
    q = torch.randn(1, H, T, D, generator=g)
    k, v = (torch.randn(1, KV, N + T, D, generator=g) for _ in range(2))
    vis = torch.ones(T, N + T, dtype=torch.bool).tril(N)  # a prompt's causal block after N keys
    if tree:
        vis[:, N:] = (torch.rand(T, T, generator=g) < 0.4).tril() | torch.eye(T, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1),
        attn_mask=vis[None, None], scale=D ** -0.5).transpose(1, 2)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = quant.row_attention(q, k, v, vis[None, None], D ** -0.5)
            assert (out.double() - want).abs().max() < 1e-5
            for t in range(T):
                keys = vis[t].nonzero()[:, 0]
                alone = quant.row_attention(q[:, :, t:t + 1], k[:, :, keys], v[:, :, keys], None, D ** -0.5)
                assert torch.equal(alone[:, 0], out[:, t]), (threads, t)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("act", quant.ACTS)
def test_without_the_avx512_kernels_speculation_still_equals_ar(act, monkeypatch):
    """set_forward(kernels=False), as on an AVX2-only CPU: the lean layers attend with the AVX2
    row attention (the prompt too), so q8 speculation reproduces q8 ar token for token."""
    monkeypatch.setenv(quant.ACT_ENV, act)
    target, draft = quantized_pair("Q4_1")
    set_forward(target, "lean", kernels=False)
    set_forward(draft, "lean", kernels=False)
    assert all(layer._lean["quant_attention"] and layer._lean["ops"] is quant.ops for layer in target.model.layers)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for cfg in LOSSLESS:
        eng = build_engine(target, draft, cfg, GREEDY)
        for prompt in ([1, 5, 7, 3], [9, 9, 9, 4, 4, 4, 11, 30, 17]):
            assert eng.generate(prompt, 40)[0] == ar.generate(prompt, 40)[0], cfg.name


def test_the_packed_forward_keeps_float_activations_unless_asked(monkeypatch):
    """The packed forward keeps transformers' layers (torch's attention, not batch-invariant), so
    its quantized linears take float32 activations by default (q8 would turn its last-bit
    differences into quanta); an explicit $SPECSTOP_QUANT_ACT=q8 is obeyed."""
    monkeypatch.delenv(quant.ACT_ENV, raising=False)
    target, _ = quantized_pair()
    set_forward(target, "packed")
    assert {m._few.act for m in target.modules() if getattr(m, "_few", None) is not None} == {"f32"}
    target, _ = quantized_pair()
    set_forward(target, "lean")
    assert {layer._lean["qkv"].few.act for layer in target.model.layers} == {quant.act()}
