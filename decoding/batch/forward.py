"""One target forward for the draft trees of several requests, each with its own KV cache.

Why: a verify of a few rows costs about what one row costs (the weights are read once), so the
rows of all active requests go through the linears TOGETHER; attention is the only step that
mixes rows, and it runs per request segment against that request's own cache (its committed
tokens, then its pending tokens and tree, tree mask per request). A request's cache is a plain
CachedModel: requests join and leave between rounds and nothing is copied.

Per layer: norm + q/k/v linear over the stacked rows -> rotary per row -> per segment: append
its keys / values to its own cache, attend with its own mask -> o linear, norm, MLP over the
stacked rows. Two layer bodies:
  * the reference: transformers' own modules and attention function (eager forward; the packed
    forward too, whose linears are the modules' packed copies);
  * the lean forward (decoding.forward.lean): its fused linears and kernels, step for step.
Batch invariance (lean, decoding.forward.kernels built): the linears give a row the same bits
whatever the other rows while the round's TOTAL rows stay within the few-row kernels (fp32 panels:
PANEL_ROWS = 32; bf16 AMX: 65; GGUF blocks: any count), and `row_attention` depends only on a
row's visible keys; there a request's logits equal its batch-1 logits bit for bit
(tests/decoding/test_batched_stacked_rows.py checks it). Above, rows agree to rounding.

Models the stacked forward does not know (not a Llama-family layer, a sliding window) are fed one
request at a time by CachedModel.feed: the same result, no shared weight read.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from decoding.kv_cache import CachedModel, additive_mask
from decoding.forward.lean import FAMILIES, add_norm, causal_mask
from decoding.tree import TreeLayout, attention_rows


@dataclass
class Segment:
    """One request's rows in a stacked verify: its pending committed tokens, then its tree."""

    cache: CachedModel
    committed: list[int]
    layout: TreeLayout
    tokens: list[int]
    capture: tuple[int, ...] = ()
    """Layers whose INPUT rows this request wants back (a feature head's aux layers)."""
    captured: torch.Tensor | None = field(default=None, repr=False)
    """[rows, len(capture) * hidden] after the forward (pending rows first, then the tree)."""

    @property
    def pending(self) -> list[int]:
        return list(self.committed[self.cache.length:])

    @property
    def rows(self) -> int:
        return len(self.pending) + len(self.tokens)

    @property
    def kept(self) -> int:
        """Rows whose logits come back: the last pending token's and each node's."""
        return len(self.tokens) + (1 if self.pending else 0)


def stackable(model) -> str | None:
    """None when `model` takes the stacked forward, else why not (then requests go one by one)."""
    if "_specstop_unstackable" not in model.__dict__:
        model.__dict__["_specstop_unstackable"] = _why_not(model)
    return model.__dict__["_specstop_unstackable"]


def _why_not(model) -> str | None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb") or not hasattr(model.model, "embed_tokens"):
        return "not a decoder with embed_tokens / rotary_emb / layers"
    if any(type(layer).__name__ not in FAMILIES for layer in layers):
        return "not a Llama-family layer"
    if CachedModel(model).plan.window is not None:
        return "a sliding window"
    return None


@torch.inference_mode()
def verify_many(model, segments: list[Segment]) -> list[torch.Tensor]:
    """Feed every segment in ONE forward; returns each segment's logits (float [kept, V]: the last
    pending token's row, if any, then each tree node's), as CachedModel.feed(committed, layout,
    tokens, 0, size) would, and fills `captured`. Each segment's cache then holds its pending
    tokens and its tree; commit it with CachedModel.commit as after a feed."""
    if not segments:
        return []
    if stackable(model) is not None:
        return [_one(model, s) for s in segments]
    dev = model.device
    ids, pos, spans, at = [], [], [], 0
    for s in segments:
        pend = s.pending
        ids += pend + list(s.tokens)
        p = torch.arange(s.cache.length, len(s.committed))
        if s.tokens:
            p = torch.cat([p, len(s.committed) - 1 + s.layout.depth_ids[: len(s.tokens)]])
        pos.append(p)
        spans.append((at, at + len(pend) + len(s.tokens), len(pend), len(s.tokens)))
        at = spans[-1][1]
    masks = [_mask(s, sp[2], sp[3], model.dtype, dev) for s, sp in zip(segments, spans)]
    x = model.model.embed_tokens(torch.tensor([ids], device=dev))
    pe = model.model.rotary_emb(x, torch.cat(pos).to(dev)[None])
    want = sorted({i for s in segments for i in s.capture})
    got: dict[int, torch.Tensor] = {}
    one = _one_call_masks(model, segments, spans, masks)
    if one is not None:  # every layer in one kernel call (the weights read once, per-request attention inside)
        x, pe = x[0], tuple(c.reshape(x.shape[1], -1).contiguous() for c in pe)
    st = _stack(model) if one is not None else None
    if st is not None:
        x, caps = _one_call_stack(st, x, pe, segments, spans, one, want)
        got = dict(zip(want, caps))
    else:
        for i, layer in enumerate(model.model.layers):
            if i in want:
                got[i] = x if one is not None else x[0]
            if one is not None:
                x = _one_call_layer(layer, x, pe, segments, spans, one)
                continue
            body = _lean_layer if hasattr(layer, "_lean") else _reference_layer
            x = body(layer, x, pe, segments, spans, masks)
    x = x[None] if one is not None else x
    keep = torch.cat([torch.arange(b - s.kept, b) for s, (a, b, _, _) in zip(segments, spans)]).to(dev)
    logits = model.lm_head(model.model.norm(x[:, keep]))[0].float()
    out, at = [], 0
    for s, (a, b, _, _) in zip(segments, spans):
        out.append(logits[at:at + s.kept])
        at += s.kept
        if s.capture:
            s.captured = torch.cat([got[i][a:b] for i in s.capture], -1)
        s.cache.length = len(s.committed)
    return out


def feed_one(cache: CachedModel, committed: list[int], layout: TreeLayout, tokens: list[int]) -> torch.Tensor:
    """The batch-1 engine's verify: `cache.feed(committed, layout, tokens, 0, len(tokens))[0]`,
    through verify_many where the target's lean layers take the whole-stack call (one kernel call
    for every layer, not transformers' model forward and a Python call a layer), else feed itself.
    Under capture_aux the layer inputs a feature head reads are published as taps, as the static
    forward publishes them (its hooks do not run here)."""
    model = cache.model
    if type(cache) is not CachedModel or cache.plan.window is not None or stackable(model) is not None \
            or _stack(model) is None:
        return cache.feed(committed, layout, tokens, 0, len(tokens))[0]
    layers = tuple(getattr(model, "_specstop_capturing", ()) or ())
    seg = Segment(cache, list(committed), layout, list(tokens), capture=layers)
    logits = verify_many(model, [seg])[0]
    if layers:
        c = seg.captured.shape[-1] // len(layers)
        model._specstop_taps = {i: seg.captured[None, :, k * c:(k + 1) * c] for k, i in enumerate(layers)}
    return logits


def _one(model, s: Segment) -> torch.Tensor:
    """The fallback: this request's own forward (CachedModel.feed), capturing by pre-hooks."""
    if not s.capture:
        return s.cache.feed(s.committed, s.layout, s.tokens, 0, len(s.tokens))[0]
    from decoding.drafts.capture import capture_aux

    with capture_aux(model, s.capture) as cap:
        logits = s.cache.feed(s.committed, s.layout, s.tokens, 0, len(s.tokens))[0]
    s.captured = cap.aux()[0]
    return logits


def _mask(s: Segment, pending: int, nodes: int, dtype, dev) -> torch.Tensor | None:
    """The segment's additive mask [1, 1, rows, cached + rows], as CachedModel.feed builds it;
    None where feed lets transformers build a causal one (a plain step; a prompt from an empty
    cache)."""
    if nodes or (pending > 1 and s.cache.length):
        rows = attention_rows(s.cache.length, pending, s.layout.mask, 0, nodes)
        return additive_mask(rows, dtype, dev)
    return None


def _one_call_masks(model, segments, spans, masks) -> list | None:
    """The segments' masks as the one-call layer takes them, or None where this round does not run
    that way: as the lean forward decides for one request (decoding.forward.lean's
    _kernel_layer_forward), every segment's rows within its attention kernel, a prompt's causal
    block as a mask, every cache a growing one."""
    f = getattr(model.model.layers[0], "_lean", None)
    if not f or not f["one_call"] or spans[-1][1] >= f["one_call"]:
        return None
    out = []
    for s, (lo, hi, *_), m in zip(segments, spans, masks):
        layer = s.cache.cache.layers[f["layer"]] if len(s.cache.cache.layers) > f["layer"] else None
        if hi - lo >= f["row_attention_below"] or not hasattr(layer, "room"):
            return None
        if m is None and hi - lo > 1:
            if not f["causal_rows"]:  # a prompt from an empty cache: torch's attention, one request at a time
                return None
            m = causal_mask(hi - lo, s.cache.model.device)
        out.append(m)
    return out


def _one_call_layer(layer, x, pe, segments, spans, masks):
    """The lean layer of every segment in one `decoder_layer_segments` call (csrc/layer.cpp,
    csrc/quant_layer.cpp): each request's rows as its batch-1 one-call layer computes them, bit for
    bit; the keys and values written into each request's own cache buffers. x [R, C] -> [R, C]."""
    f = layer._lean
    rooms = [s.cache.cache.layers[f["layer"]] for s in segments]
    got = [c.room(f["kv_like"], hi - lo) for c, (lo, hi, *_) in zip(rooms, spans)]
    y = f["ops"].decoder_layer_segments(
        x, *pe, [g[0] for g in got], [g[1] for g in got], [g[2] for g in got], [g[3] for g in got],
        [hi - lo for lo, hi, *_ in spans], masks, f["weights"], f["qkv"].bias, [1, *f["dims"]],
        f["norm1"][1], f["norm2"][1], f["scaling"])
    for c, g, (lo, hi, *_) in zip(rooms, got, spans):
        c.grown(g[2], g[3] + hi - lo)
    return y


def _stack(model) -> dict | None:
    """What `decoder_stack_segments` takes of every layer, laid out layer after layer (built once
    per lean binding), or None where the layers do not all run one-call on one library."""
    fs = [getattr(layer, "_lean", None) for layer in model.model.layers]
    if not fs or any(not f or not f.get("one_call") for f in fs):
        return None
    if "stack" not in fs[0]:
        ops = fs[0]["ops"]
        ok = all(f["ops"] is ops and f["scaling"] == fs[0]["scaling"] for f in fs) \
            and hasattr(ops, "decoder_stack_segments")
        fs[0]["stack"] = dict(
            op=ops.decoder_stack_segments, w=[t for f in fs for t in f["weights"]], bias=[f["qkv"].bias for f in fs],
            dims=[d for f in fs for d in (1, *f["dims"])], eps1=[float(f["norm1"][1]) for f in fs],
            eps2=[float(f["norm2"][1]) for f in fs], scale=fs[0]["scaling"],
            rooms=[(f["layer"], f["kv_like"]) for f in fs]) if ok else None
    return fs[0]["stack"]


def _one_call_stack(st: dict, x, pe, segments, spans, masks, want):
    """Every layer of every segment in one `decoder_stack_segments` call (st: _stack's): what
    _one_call_layer does a layer, bit for bit, without a trip through Python a layer. Returns (x,
    the inputs of the layers in `want`)."""
    rows = [hi - lo for lo, hi, *_ in spans]
    caches = [s.cache.cache.layers for s in segments]
    rooms, got = [], []
    for layer, like in st["rooms"]:
        for c, t in zip(caches, rows):
            rooms.append(c[layer])
            got.append(c[layer].room(like, t))
    y, caps = st["op"](x, *pe, [g[0] for g in got], [g[1] for g in got], [g[2] for g in got],
                       [g[3] for g in got], rows, masks, st["w"], st["bias"], st["dims"], st["eps1"],
                       st["eps2"], st["scale"], want)
    for c, g, t in zip(rooms, got, rows * len(st["rooms"])):
        c.grown(g[2], g[3] + t)
    return y, caps


def _reference_layer(layer, x, pe, segments, spans, masks):
    """transformers' decoder layer, its linears over the stacked rows [1, R, C]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    a = layer.self_attn
    mod = sys.modules[type(layer).__module__]
    shape = (1, x.shape[1], -1, a.head_dim)
    h = layer.input_layernorm(x)
    q, k, v = a.q_proj(h).view(shape), a.k_proj(h).view(shape), a.v_proj(h).view(shape)
    if hasattr(a, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = mod.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *pe)
    v = v.transpose(1, 2)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(a.config._attn_implementation, mod.eager_attention_forward)
    outs = []
    for s, (lo, hi, *_), m in zip(segments, spans, masks):
        ks, vs = s.cache.cache.update(k[:, :, lo:hi], v[:, :, lo:hi], a.layer_idx)
        if m is None and hi - lo > 1:  # a prompt from an empty cache: causal
            m = additive_mask(torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril_(), x.dtype, x.device)
        o, _ = attend(a, q[:, :, lo:hi], ks, vs, m, dropout=0.0, scaling=a.scaling)
        outs.append(o.reshape(1, hi - lo, -1))
    x = x + a.o_proj(torch.cat(outs, 1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _lean_layer(layer, x, pe, segments, spans, masks):
    """decoding.forward.lean's layer, the same ops in the same order per row (so a row's bits are
    those of its batch-1 forward where the kernels are batch-invariant), attention per segment."""
    f = layer._lean
    a = layer.self_attn
    _, R, C = x.shape
    H, K, D = f["heads"], f["kv_heads"], a.head_dim
    x = x.reshape(R, C)
    ops = f["ops"]
    y = f["qkv"](add_norm(x, layer.input_layernorm, ops=ops)[1])
    cos, sin = pe
    if ops is not None and not f["qk_norm"]:  # [1, heads, R, D]
        q, k, v = ops.rope_qkv(y, cos.reshape(R, D).contiguous(), sin.reshape(R, D).contiguous(),
                                              1, H, K)
    else:
        y = y.view(1, R, H + 2 * K, D)
        if f["qk_norm"]:
            qk = torch.cat([F.rms_norm(y[:, :, :H], a.q_norm.weight.shape, a.q_norm.weight, a.q_norm.variance_epsilon),
                            F.rms_norm(y[:, :, H:H + K], a.k_norm.weight.shape, a.k_norm.weight,
                                       a.k_norm.variance_epsilon)], 2).transpose(1, 2)
        else:
            qk = y[:, :, :H + K].transpose(1, 2)
        c, s_ = cos[:, None], sin[:, None]
        qk = qk * c + torch.cat((-qk[..., D // 2:], qk[..., :D // 2]), -1) * s_
        q, k, v = qk[:, :H], qk[:, H:], y[:, :, H + K:].transpose(1, 2)
    outs = []
    for s, (lo, hi, *_), m in zip(segments, spans, masks):
        ks, vs = s.cache.cache.update(k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous(), a.layer_idx)
        outs.append(_attend(f, a, q[:, :, lo:hi].contiguous(), ks, vs, m, hi - lo, x.device))
    x, h = add_norm(x, layer.post_attention_layernorm, f["o"](torch.cat(outs)), ops)
    g = f["gate_up"](h)
    g = ops.silu_mul(g) if ops is not None else F.silu(g[:, : f["inter"]]) * g[:, f["inter"]:]
    return (x + f["down"](g)).view(1, R, C)


def _attend(f, a, q, k, v, mask, T, device) -> torch.Tensor:
    """One segment's attention, dispatched as decoding.forward.lean dispatches a batch-1 forward
    of T rows; [T, H * D]."""
    H, K = f["heads"], f["kv_heads"]
    if mask is None and T > 1 and f["causal_rows"]:
        mask = causal_mask(T, device)
    if mask is not None:
        mask = mask[..., : k.shape[2]]
    if f["ops"] is not None and T <= f["row_attention_below"] and (mask is not None or T == 1):
        return f["ops"].row_attention(q, k, v, mask, a.scaling).reshape(T, -1)
    causal = mask is None and T > 1
    k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 KV cache (decoding.kv_cache.set_kv_dtype), widened
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=a.scaling,
                                          enable_gqa=H != K).transpose(1, 2).reshape(T, -1)
