"""The feature head's inference step on decoding.forward.kernels.

A grown tree calls the head 3-4 times a round, each call a few rows through one decoder layer:
as torch modules that is ~90 ops (norms as 6 ops each, the rotary tables rebuilt per call, q / k /
v as three linears, the draft cache re-concatenated and expanded to every query head), most of a
call's time. `LeanStep` runs the same arithmetic as `FeatureDraft.step` in a dozen: q / k / v in
one linear, gate / up in one, one-pass RMSNorm, rotary split and SiLU gate, `row_attention` over
the cache with GQA inside, and the draft cache appended in place. Each fused step rounds once
(float32 math), so in bf16 the head's outputs move within rounding, never its target's: what
is committed is the target's decision either way (lossless), and in float32 it equals the module
step to ~1e-6 (tests/head/test_decoding_with_a_head.py compares it with training-time test).

Used (`step`) where the head runs a fast forward: on decoding.forward.kernels where they run (CPUs
with AVX512-BF16), for steps of up to `kernels.attention_rows` rows; elsewhere, for a head on
GGUF-style blocks (decoding.forward.quant), on the quantized library's AVX2 row-wise ops; else, and
for longer steps, the modules run.
"""

from __future__ import annotations

import torch

from decoding.forward import kernels

from decoding.forward import quant
from decoding.kv_cache import append_kv


class LeanStep:
    """FeatureDraft.step over fused copies of the head's layer weights (shared norms)."""

    def __init__(self, draft, ops, rows: int):
        self.ops, self.rows = ops, rows  # the row-wise ops (kernels', or quant's on AVX2) and most rows a step takes
        m, a = draft.midlayer, draft.midlayer.self_attn
        self.qkv = _fused(a.q_proj, a.k_proj, a.v_proj)
        self.o = _fused(a.o_proj)
        self.gate_up = _fused(m.mlp.gate_proj, m.mlp.up_proj)
        self.down = _fused(m.mlp.down_proj)
        self.norms = {name: (n.weight.detach(), n.eps) for name, n in (
            ("input", m.input_layernorm), ("hidden", m.hidden_norm), ("post", m.post_attention_layernorm),
            ("final", draft.norm))}
        self.inv_freq = a.inv_freq.detach().float().clone()  # fp32, as the module keeps it
        c = draft.config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if kernels.available():  # in 2 MiB pages, in the order a round reads them: fc (the target's features), the layer, lm_head
            kernels.gather([getattr(draft.fc, "_few", None), self.qkv, self.o, self.gate_up, self.down,
                            getattr(draft.lm_head, "_few", None)])

    def _norm(self, x, name):
        return self.ops.add_rms_norm(x, None, *self.norms[name])[1]

    def __call__(self, draft, tokens, hidden, positions, cache, mask, last: bool = False):
        """As FeatureDraft.step: (draft-vocab logits [B, T, N], pre-norm h [B, T, H]); last: the
        logits of each sequence's last row only, [B, 1, N] (a catch-up reads no other row's)."""
        B, T = tokens.shape
        H = hidden.shape[-1]
        h0 = hidden.reshape(B * T, H).contiguous()
        q, k, v = self._qkv(draft, tokens.reshape(B * T), h0, positions.reshape(B * T), B)
        att = self._attend(q, k, v, cache, mask).reshape(B * T, -1)
        logits, h = self._finish(draft, h0, att, torch.arange(T - 1, B * T, T) if last else None)
        return logits.view(B, 1 if last else T, -1), h.view(B, T, H)

    def many(self, draft, caches, calls):
        """Several requests' steps in one: calls[i] = (tokens [1, T], hidden [1, T, H], positions
        [1, T], mask[, last]) on caches[i]. The linears run once over every row (the head's weights
        read once a level, not once a request); attention per request over its own cache. Each row
        is what __call__ gives it alone (the few-row kernels and the attention are row-invariant)."""
        H = calls[0][1].shape[-1]
        h0 = torch.cat([c[1].reshape(-1, H) for c in calls]).contiguous()
        q, k, v = self._qkv(draft, torch.cat([c[0].reshape(-1) for c in calls]), h0,
                            torch.cat([c[2].reshape(-1) for c in calls]), 1)
        atts, spans, at = [], [], 0
        for cache, (tokens, _, _, mask, *last) in zip(caches, calls):
            T = tokens.shape[1]
            atts.append(self._attend(q[:, :, at:at + T], k[:, :, at:at + T], v[:, :, at:at + T], cache, mask)
                        .reshape(T, -1))
            spans.append((at, T, 1 if last and last[0] else T))
            at += T
        rows = None if all(T == n for _, T, n in spans) else \
            torch.cat([torch.arange(a + T - n, a + T) for a, T, n in spans])
        logits, h = self._finish(draft, h0, torch.cat(atts), rows)
        out, lo = [], 0
        for a, T, n in spans:
            out.append((logits[lo:lo + n][None], h[a:a + T][None]))
            lo += n
        return out

    def _qkv(self, draft, tokens, h0, positions, B: int):
        """tokens [R], h0 [R, H], positions [R] -> q [B, heads, R / B, d], k / v (rotary applied)."""
        x = torch.cat((self._norm(draft.embed(tokens).contiguous(), "input"), self._norm(h0, "hidden")), -1)
        ang = positions.reshape(-1, 1).float() * self.inv_freq
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().to(h0.dtype), emb.sin().to(h0.dtype)
        return self.ops.rope_qkv(self.qkv(x), cos, sin, B, self.heads, self.kv_heads)

    def _attend(self, q, k, v, cache, mask):
        """The new keys / values appended to `cache` (if any); attention over it, [B, T, heads, d]."""
        if cache is not None:
            cache.k, cache._kb = append_kv(cache.k, getattr(cache, "_kb", None), k) if cache.k is not None else (k, None)
            cache.v, cache._vb = append_kv(cache.v, getattr(cache, "_vb", None), v) if cache.v is not None else (v, None)
            k, v = cache.k, cache.v
        T, S = q.shape[2], k.shape[2]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool).tril_(S - T)
        return self.ops.row_attention(q, k, v, mask[None, None], self.head_dim ** -0.5)

    def _finish(self, draft, h0, att, rows=None):
        """o, residual, MLP over every row, then the final norm and the head's output layer over
        `rows` (None: every row): (logits, h)."""
        h, post = self.ops.add_rms_norm(h0, self.o(att), *self.norms["post"])  # h + attention, then its norm
        h = h + self.down(self.ops.silu_mul(self.gate_up(post)))
        return draft.lm_head(self._norm(h if rows is None else h[rows], "final")), h


def _fused(*linears):
    """Linears sharing an input as one weight: their GGUF-style blocks where the head was quantized
    (decoding.forward.quant.quantize_head), else packed for the few-row kernels."""
    q = [getattr(lin, "_quant", None) for lin in linears]
    if all(q):
        return quant.QuantWeight.cat(q)
    return kernels.FewRowWeight(torch.cat([lin.weight.detach() for lin in linears]).contiguous())


def step(draft, tokens, hidden, positions, cache=None, mask=None, last: bool = False):
    """`draft.step(...)`, on the lean step where it applies: the head runs a fast forward (packed /
    lean, decoding.forward.packed; eager stays the modules: the reference), the kernels run here,
    the step has few enough rows, and nothing is being trained. last: only the last row's logits
    ([B, 1, N]; the lean step computes no other)."""
    if shares_steps(draft) and tokens.shape[1] <= draft._lean_step.rows and not torch.is_grad_enabled():
        return draft._lean_step(draft, tokens, hidden, positions, cache, mask, last)
    return draft.step(tokens, hidden, positions, cache, mask, last)


def shares_steps(draft) -> bool:
    """Whether this head steps lean here (`step`; `steps`: several requests' rows in one)."""
    lean = getattr(draft, "_lean_step", False)
    if lean is False:  # once per head and fast forward (set_forward drops it, as it drops packed weights)
        lean = draft._lean_step = _build(draft)
    return lean is not None and getattr(draft, "_specstop_forward", "eager") in ("packed", "lean")


def steps(draft, caches, calls):
    """[step(draft, *call[:3], cache, *call[3:]) for each], every request's rows in one lean step
    (LeanStep.many) where the lean step applies to all of them."""
    if (len(calls) > 1 and shares_steps(draft) and all(c[0].shape[1] <= draft._lean_step.rows for c in calls)
            and not torch.is_grad_enabled()):
        return draft._lean_step.many(draft, caches, calls)
    return [step(draft, *c[:3], cache, *c[3:]) for cache, c in zip(caches, calls)]


def _build(draft):
    w = draft.fc.weight
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if kernels.batch_invariant():
        return LeanStep(draft, kernels.ops, kernels.attention_rows(w.dtype))
    m = draft.midlayer
    lins = (m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj, m.self_attn.o_proj, m.mlp.gate_proj,
            m.mlp.up_proj, m.mlp.down_proj)
    if all(getattr(lin, "_quant", None) for lin in lins) and quant.attends_here(w.dtype):
        # a head on GGUF-style blocks where the AVX512 kernels do not build: the AVX2 row-wise ops
        # (csrc/quant_layer.cpp, csrc/quant_attention.cpp) take any rows with a mask
        return LeanStep(draft, quant.ops, 1 << 30)
    return None
