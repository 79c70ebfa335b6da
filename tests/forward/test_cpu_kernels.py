"""decoding.forward.kernels: the few-row linears exact to their dtype's rounding against a float64
reference on every remainder of their blocking, batch- and thread-invariant; the row-wise ops
equal to torch's composition to one rounding; everything absent cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.models import tiny
from decoding.forward import cpu, kernels
from decoding.kv_cache import CachedModel
from decoding.forward.packed import set_forward
from decoding.tree import TreeLayout

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"no kernel here: {kernels.why_not()}")
needs_amx = pytest.mark.skipif(not kernels.amx(), reason="no AMX tiles here")


def _case(dtype, t, k, n, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _assert_float64_to_rounding(y, x, w, b):
    """y = x @ w.T + b in x's dtype, within fp32 accumulation over K (2^-20 of the terms'
    magnitude) plus one rounding of the output to the dtype."""
    dtype = x.dtype
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.dtype == dtype and y.shape == ref.shape
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    assert ((y.double() - ref).abs() <= mag * 2.0 ** -20 + ref.abs() * out_round).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,n", [(1, 64, 8), (2, 577, 37), (3, 31, 5), (4, 96, 4), (5, 1536, 9), (9, 33, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_to_the_dtypes_rounding(dtype, t, k, n, bias):
    """K not a multiple of the vector width, N not of the 4-row block, T over / under the 4-row
    pass: every tail of the loop. Accumulation is fp32, so the error bound is fp32's over K
    terms plus one rounding of the output to `dtype`."""
    x, w, b = _case(dtype, t, k, n, bias)
    _assert_float64_to_rounding(kernels.linear(x, w, b), x, w, b)


@needs_amx
@pytest.mark.parametrize("t,k,n", [(1, 64, 32), (2, 577, 37), (16, 31, 5), (17, 96, 70), (33, 1536, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_tiles_equal_float64_to_bf16_rounding(t, k, n, bias):
    """AMX: K and N padded to the tiles' 32, rows over one (16) and two (32) tiles of x."""
    x, w, b = _case(torch.bfloat16, t, k, n, bias)
    _assert_float64_to_rounding(kernels.FewRowWeight(w)(x, b), x, w, b)


@needs_kernel
@pytest.mark.parametrize("t,k,n", [(1, 64, 48), (2, 577, 37), (8, 31, 130), (9, 96, 70), (13, 40, 100),
                                   (16, 577, 130), (33, 1536, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_panels_equal_float64_to_fp32_rounding(t, k, n, bias):
    """fp32 panels: N padded to the panels' 48 (tails of 16-lane vectors too), rows in one pass
    (up to 8) or in balanced groups over chunks of K (9 = 4 + 5, 13 = 6 + 7, 16, 33; K of one
    chunk, several, a 1-step tail), one FMA chain per output."""
    x, w, b = _case(torch.float32, t, k, n, bias)
    _assert_float64_to_rounding(kernels.FewRowWeight(w)(x, b), x, w, b)


def _rows_alone_and_together(kernel, x, b):
    th = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel(x[i:i + 1].contiguous(), b) for i in range(x.shape[0])]
        torch.set_num_threads(2)
        together = kernel(x, b)
    finally:
        torch.set_num_threads(th)
    return alone, together


@needs_kernel
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 7), (torch.float32, 33), (torch.bfloat16, 7),
                                        (torch.bfloat16, 33)])
def test_a_row_does_not_depend_on_the_other_rows_or_threads(dtype, rows):
    """Whatever the call carries, row i is the row fed alone, bit for bit, on 1 thread and on 2:
    the row-major kernel (one fp32 chain per output), the fp32 panels and, in bf16 where the CPU
    has them, the AMX tiles (a verify of up to 32 rows and a 1-token step agree exactly)."""
    if rows > 7 and dtype == torch.bfloat16 and not kernels.amx():
        pytest.skip("no AMX tiles here")
    x, w, b = _case(dtype, rows, 577, 203, True, seed=1)
    candidates = [lambda x, b: kernels.linear(x, w, b)]
    if dtype == torch.float32 or kernels.amx():
        candidates.append(kernels.FewRowWeight(w))
    for kernel in candidates[-1:] if rows > 7 else candidates:
        alone, together = _rows_alone_and_together(kernel, x, b)
        for i in range(rows):
            assert torch.equal(together[i:i + 1], alone[i])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_wise_ops_equal_torchs_composition_to_one_rounding(dtype):
    """RMSNorm (with and without the residual add), the rotary split of a fused q/k/v row block
    (B = 2, T = 3, GQA) and the SiLU gate, against torch in float32 rounded once."""
    g = torch.Generator().manual_seed(3)
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6  # one rounding, relative to the magnitude
    x, r = (torch.randn(5, 577, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(577, generator=g).to(dtype)
    s, y = torch.ops.specstop.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)  # the residual stream as torch stores it
    want = F.rms_norm(s.float(), (577,), w.float(), 1e-5)
    assert ((y.float() - want).abs() <= tol * want.abs() + 1e-6).all()
    same, y0 = torch.ops.specstop.add_rms_norm(x, None, w, 1e-5)
    want = F.rms_norm(x.float(), (577,), w.float(), 1e-5)
    assert same is x or torch.equal(same, x)
    assert ((y0.float() - want).abs() <= tol * want.abs() + 1e-6).all()

    B, T, H, K, D = 2, 3, 6, 2, 16
    y = torch.randn(B * T, (H + 2 * K) * D, generator=g).to(dtype)
    ang = torch.randn(B, T, D // 2, generator=g)
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(dtype) for f in (torch.cos, torch.sin))
    q, k, v = torch.ops.specstop.rope_qkv(y, cos.reshape(B * T, D), sin.reshape(B * T, D), B, H, K)
    yy = y.float().view(B, T, H + 2 * K, D)
    qk = yy[:, :, :H + K].transpose(1, 2)
    rot = qk * cos.float()[:, None] + torch.cat((-qk[..., D // 2:], qk[..., :D // 2]), -1) * sin.float()[:, None]
    assert q.shape == (B, H, T, D) and k.shape == v.shape == (B, K, T, D)
    for got, want in ((q, rot[:, :H]), (k, rot[:, H:])):
        assert ((got.float() - want).abs() <= tol * want.abs() + 1e-6).all()
    assert torch.equal(v.float(), yy[:, :, H + K:].transpose(1, 2))

    gu = torch.randn(4, 2 * 96, generator=g).to(dtype)
    want = F.silu(gu[:, :96].float()) * gu[:, 96:].float()
    assert ((torch.ops.specstop.silu_mul(gu).float() - want).abs() <= tol * want.abs() + 1e-6).all()


@needs_kernel
def test_a_lean_step_runs_on_the_kernel_and_agrees_with_onednn():
    """A 1-token lean step goes through the kernel (bf16 and fp32) and gives oneDNN's logits to
    rounding."""
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny("llama").to(dtype)
        logits = {}
        for small in (True, False):
            set_forward(model, "lean", kernels=small)
            qkv = model.model.layers[0]._lean["qkv"]
            assert qkv.small_below == (kernels.rows_below(dtype) if small else 0)
            assert model.lm_head._small_below == qkv.small_below
            cm = CachedModel(model)
            cm.feed(list(range(3, 14)), TreeLayout(()), [], 0, 0)
            with torch.profiler.profile() as prof:
                logits[small] = cm.feed(list(range(3, 15)), TreeLayout(()), [], 0, 0)[0]
            ops = {e.key for e in prof.key_averages()}
            assert bool(ops & {"specstop::small_linear", "specstop::amx_linear", "specstop::panel_linear"}) == small
        tol = 1e-4 if dtype == torch.float32 else 0.02 * logits[False].abs().max()
        assert (logits[True] - logits[False]).abs().max() <= tol


def test_off_by_environment_or_cpu_or_failed_build(monkeypatch):
    """$SPECSTOP_CPU_KERNELS=0, a CPU without the instructions, a build that fails: not available,
    one phrase why, and rows_below is 0 (linears stay oneDNN's)."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.available() and kernels.why_not() == f"${kernels.ENV}=0"
    assert kernels.rows_below(torch.bfloat16) == 0
    monkeypatch.delenv(kernels.ENV)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2"})
    assert "the CPU lacks avx512f" in kernels.why_not()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpu, "flags", lambda: set(kernels.FLAGS))
    monkeypatch.setattr(kernels, "_registered", lambda: False)

    def fail():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(kernels, "_build", fail)
    with pytest.warns(UserWarning, match="linears stay oneDNN's"):
        assert "did not build (RuntimeError: Ninja is required" in kernels.why_not()
    assert kernels.rows_below(torch.float32) == 0


def _sdpa64(q, k, v, visible, scale):
    """float64 attention over the visible keys (bool [T, N]), GQA by repeating kv heads."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(rep, 1) for x in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)  # [B, T, H, D]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_row_attention_equals_float64_attention(dtype, kind):
    """GQA (6 query heads over 2), keys and values as views into a longer cache buffer, a tree
    mask as bool or additive (the dtype's min where hidden), or no mask (every key visible)."""
    g = torch.Generator().manual_seed(5)
    B, H, KV, T, N, D = 1, 6, 2, 1 if kind == "none" else 4, 37, 64
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    buf = torch.randn(2, B, KV, 64, D, generator=g).to(dtype)
    k, v = buf[0][:, :, :N], buf[1][:, :, :N]
    visible = torch.ones(T, N, dtype=torch.bool)
    if kind != "none":
        visible[:, N - T:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = {"none": None, "bool": visible[None, None],
            "additive": torch.zeros(T, N, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]}[kind]
    got = torch.ops.specstop.row_attention(q, k, v, mask, D ** -0.5)
    want = _sdpa64(q, k, v, visible, D ** -0.5)
    assert got.shape == (B, T, H, D)
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= tol * want.abs() + tol * 0.05).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, KV, T, D", [(4, 2, 5, 32), (9, 3, 20, 64), (4, 4, 3, 48)])
def test_row_attention_of_a_row_depends_on_its_visible_keys_only(dtype, H, KV, T, D):
    """A row attended alone over the prefix and its ancestors (a plain step: no mask, keys in the
    order they were committed) equals the same row inside a verify of a tree that carries more
    rows (here up to 60 query rows per kv head: several lane vectors and tasks) and more keys,
    the masked ones between its ancestors: bit for bit, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(6 + T)
    N = 50 + T % 7  # cached keys: not a whole number of 16-key tiles
    parent = [-1] + [int(torch.randint(0, t, (1,), generator=g)) for t in range(1, T)]  # a random tree
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, KV, N + T, D, generator=g).to(dtype) for _ in range(2))
    visible = torch.zeros(T, N + T, dtype=torch.bool)
    visible[:, :N] = True
    path = []
    for t in range(T):
        a, path_t = t, []
        while a >= 0:
            path_t.append(a)
            a = parent[a]
        path.append(path_t[::-1])  # root .. t
        visible[t, [N + a for a in path_t]] = True
    _each_row_as_alone(q, k, v, visible, 0.2, lambda t: list(range(N)) + [N + a for a in path[t]])


def _each_row_as_alone(q, k, v, visible, scale, keys_of):
    """Row t of one call (mask `visible` [T, N]) equals row t attended alone over keys_of(t), with
    no mask (a plain step), bit for bit, on 1 and 2 threads."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            both = torch.ops.specstop.row_attention(q, k, v, visible[None, None], scale)
            for t in range(q.shape[2]):
                idx = keys_of(t)
                alone = torch.ops.specstop.row_attention(q[:, :, t:t + 1].contiguous(), k[:, :, idx], v[:, :, idx],
                                                         None, scale)
                assert torch.equal(both[:, t], alone[:, 0]), (threads, t)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [0, 13])
def test_a_causal_prompt_row_equals_the_row_alone_over_its_keys(dtype, N):
    """A prompt's causal block (after N cached keys): a task reads keys only up to the last one its
    rows see, and tasks run in a zigzag order across threads. Row t equals the row attended alone
    over keys [0, N + t], bit for bit, on 1 and 2 threads (70 rows x 3 query heads: 7 tasks)."""
    g = torch.Generator().manual_seed(9 + N)
    H, KV, T, D = 9, 3, 70, 64
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, KV, N + T, D, generator=g).to(dtype) for _ in range(2))
    visible = torch.ones(T, N + T, dtype=torch.bool).tril(N)
    _each_row_as_alone(q, k, v, visible, 0.125, lambda t: list(range(N + t + 1)))


@needs_amx
def test_bf16_verify_rows_equal_the_plain_steps_bit_for_bit(monkeypatch):
    """By default, with AMX linears, the row-wise kernels and row attention, a bf16 verify of a
    chain of up to 65 tokens (a grown tree's 64 nodes and the pending one) gives each row exactly
    the logits a 1-token step gives it, so bf16 greedy speculation reproduces bf16 `ar` with no
    near-tie flips."""
    monkeypatch.delenv(kernels.INVARIANT_ENV, raising=False)
    assert kernels.batch_invariant() and "batch-invariant" in kernels.describe()
    model = tiny("llama").to(torch.bfloat16)
    set_forward(model, "lean")
    assert model.model.layers[0]._lean["row_attention_below"] == 66 == kernels.rows_below(torch.bfloat16)
    V = model.config.vocab_size
    prompt, nxt = [(3 * i + 1) % V for i in range(27)], [(7 * i + 5) % V for i in range(65)]
    from decoding.tree import layout_from_k_config

    for n in (2, 9, 33, 65):
        steps = CachedModel(model)
        steps.feed(prompt, TreeLayout(()), [], 0, 0)
        one = [steps.feed(prompt + nxt[:i + 1], TreeLayout(()), [], 0, 0)[0][-1] for i in range(n)]
        cm = CachedModel(model)
        cm.feed(prompt, TreeLayout(()), [], 0, 0)
        many = cm.feed(prompt + nxt[:1], layout_from_k_config([1] * (n - 1)), nxt[1:n], 0, n - 1)[0]
        assert torch.equal(torch.stack(one), many)
    monkeypatch.setenv(kernels.INVARIANT_ENV, "0")
    set_forward(model, "eager")
    set_forward(model, "lean")  # turned off: torch's attention
    assert model.model.layers[0]._lean["row_attention_below"] == 0 and not kernels.batch_invariant()


def test_the_kernel_sources_ship_with_the_package():
    """A wheel carries every source and header the build reads (package-data patterns)."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["decoding"]
    for f in (root / "decoding" / "forward" / "csrc").iterdir():
        if f.suffix in (".cpp", ".h"):
            assert any(fnmatch.fnmatch(f"forward/csrc/{f.name}", p) for p in patterns), f.name
    assert set(kernels.SOURCES) <= set((root / "decoding" / "forward" / "csrc").iterdir())
