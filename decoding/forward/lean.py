"""The lean forward: a Llama-family decoder layer as a few fused ops over prepacked weights.

Where a packed forward's time goes (`python -m decoding.bench --suite forward`): on a 2-core
AMX Xeon a 1-token bf16 forward of SmolLM2-135M is ~30 ms of GEMMs and ~16 ms of everything
else: ~5,500 ops, most of them the framework's bookkeeping around seven small linears, two
norms and the rotary embedding of each of 30 layers. The lean layer does the same arithmetic in
fewer, larger steps: q, k and v in ONE linear (their weights concatenated), gate and up in one,
one-pass RMSNorm, the rotary embedding on q and k together, attention with GQA inside. Where
decoding.forward.kernels is built (CPUs with AVX512-BF16), those steps run on its kernels: few-row
linears that stream the weights at the core's rate (AMX tiles for bf16), one-pass norm / rotary
/ SiLU gate, and attention whose rows depend only on their visible keys (so a row's result does not
depend on how many rows or masked keys the forward carries; $SPECSTOP_BATCH_INVARIANT=0: torch's
scaled_dot_product_attention instead); elsewhere they are torch's ops on oneDNN's prepacked linears. The model around the layers (embedding, masks, rotary
tables, final norm, output layer) and the KV cache stay transformers' own, so the engine's cache
bookkeeping, its tree masks and the feature heads' pre-hooks on the layers are unchanged.

Where all of a layer's steps run on the kernels (a step or a verify, AMX or fp32 panels, no
per-head q/k norms), the whole layer is ONE call, `specstop::decoder_layer` (csrc/layer.cpp): the
same kernels in the same order, so the same result bit for bit, without ~20 us a layer of Python
and dispatch between them; it writes the new keys and values into the cache's buffer itself
(decoding.kv_cache: `room` / `grown`).

Only layers whose arithmetic is known are replaced (`FAMILIES`: Llama, Mistral, Qwen2, Qwen3 with
silu MLPs and RMSNorm); anything else keeps transformers' layer, and the kind is then "packed".
The result equals the eager forward to rounding (float32: ~1e-5; bfloat16: each fused step
rounds once), so it is a forward of its own: greedy equality and exact sampling are proven on it
(tests/decoding/test_greedy_equals_plain.py, tests/decoding/test_exact_sampling.py), and a bf16 lean row agrees with a
bf16 lean `ar`, not with an eager one.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from decoding.forward import kernels

from decoding.forward import quant

FAMILIES = {  # decoder layer class -> per-head q/k norms (Qwen3)
    "LlamaDecoderLayer": False, "MistralDecoderLayer": False, "Qwen2DecoderLayer": False,
    "Qwen3DecoderLayer": True,
}
QUANT_ROWS = 1 << 30
"""A quantized linear runs on decoding.forward.quant's kernel at every row count (a prefill too), so the
prompt, a step and a verify share one law."""
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * x / rms(x)


def why_not(layer, config) -> str | None:
    """None when `layer` can run lean; else what stops it (one phrase)."""
    name = type(layer).__name__
    if name not in FAMILIES:
        return f"{name} is not a known Llama-family layer"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "the MLP is not a bias-free silu gate"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if FAMILIES[name]:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    if any(type(n).__name__ not in NORMS for n in norms):
        return "a norm is not RMSNorm"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention {config._attn_implementation!r}"
    return None


class _Fused:
    """Linears sharing an input, as one: their weights concatenated, run by the few-row kernels
    below `small_below` rows (decoding.forward.kernels), prepacked by oneDNN above; the modules
    themselves below `eager_below` rows where no few-row kernel is there (float32: the default
    kernel beats oneDNN's there)."""

    def __init__(self, linears, pack, eager_below: int, small_below: int = 0):
        self.linears = linears
        b = [m.bias for m in linears]
        self.bias = None if b[0] is None else torch.cat([x.detach() for x in b])
        q = [getattr(m, "_quant", None) for m in linears]
        q = quant.QuantWeight.cat(q) if all(q) else None
        if q is not None:  # a GGUF's blocks: every row count multiplies by them (decoding.forward.quant)
            self.packed = self.plain = None
            self.eager_below, self.small_below, self.few = 0, QUANT_ROWS, q
            return
        w = torch.cat([m.weight.detach() for m in linears]).contiguous()
        self.packed = pack(w)
        self.plain = w if self.packed is None else None  # no oneDNN: one plain linear
        self.eager_below = eager_below
        self.small_below = small_below
        self.few = kernels.FewRowWeight(w) if small_below else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.small_below:
            return self.few(x.contiguous(), self.bias)
        if self.packed is None:
            return F.linear(x, self.plain, self.bias)
        if x.shape[0] < self.eager_below:
            ys = [F.linear(x, m.weight, m.bias) for m in self.linears]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def add_norm(x: torch.Tensor, norm, res: torch.Tensor | None = None, ops=None):
    """(x + res, RMSNorm of it); one pass of a kernel where the layer has row-wise `ops` (its
    f["ops"]: torch's rms_norm on a CPU is ~10 ops, ~12 us a row)."""
    if ops is not None:
        return ops.add_rms_norm(x.contiguous(), None if res is None else res.contiguous(),
                                norm.weight, norm.variance_epsilon)
    x = x if res is None else x + res
    return x, _rms(x, norm)


def _lean_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                        use_cache=False, position_embeddings=None, **kwargs):
    """transformers' decoder-layer call, lean (see the module docstring); [B, T, C] -> [B, T, C]."""
    f = self._lean
    a = self.self_attn
    B, T, C = hidden_states.shape
    H, K, D = f["heads"], f["kv_heads"], a.head_dim
    if attention_mask is None and T > 1 and f["causal_rows"]:  # a prompt from an empty cache
        attention_mask = causal_mask(T, hidden_states.device)
    x = hidden_states.reshape(B * T, C)
    ops = f["ops"]
    y = f["qkv"](add_norm(x, self.input_layernorm, ops=ops)[1])
    cos, sin = position_embeddings  # [B or 1, T, D]
    if ops is not None and not f["qk_norm"]:  # one pass: split, rotate q and k, lay out [B, heads, T, D]
        q, k, v = ops.rope_qkv(y, cos.expand(B, T, D).reshape(B * T, D).contiguous(),
                                              sin.expand(B, T, D).reshape(B * T, D).contiguous(), B, H, K)
    else:
        y = y.view(B, T, H + 2 * K, D)
        if f["qk_norm"]:  # Qwen3: per-head norms before the rotary embedding
            qk = torch.cat([_rms(y[:, :, :H], a.q_norm), _rms(y[:, :, H:H + K], a.k_norm)], 2).transpose(1, 2)
        else:
            qk = y[:, :, :H + K].transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        qk = qk * cos + torch.cat((-qk[..., D // 2:], qk[..., :D // 2]), -1) * sin
        q, k, v = qk[:, :H], qk[:, H:], y[:, :, H + K:].transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, a.layer_idx)
    mask = attention_mask[..., : k.shape[2]] if attention_mask is not None else None
    causal = mask is None and T > 1
    if causal and k.shape[2] > T:  # transformers builds a mask whenever a cache precedes the rows
        raise RuntimeError("lean forward: a causal block after cached tokens needs a mask")
    if ops is not None and T <= f["row_attention_below"] and (mask is not None or T == 1):  # [B, T, H, D]
        att = ops.row_attention(q, k, v, mask, a.scaling).reshape(B * T, H * D)
    else:  # (a float16 KV cache widened for torch's attention: decoding.kv_cache.set_kv_dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=a.scaling,
                                             enable_gqa=H != K).transpose(1, 2).reshape(B * T, H * D)
    x, h = add_norm(x, self.post_attention_layernorm, f["o"](att), ops)
    g = f["gate_up"](h)
    g = ops.silu_mul(g) if ops is not None else F.silu(g[:, : f["inter"]]) * g[:, f["inter"]:]
    x = x + f["down"](g)
    return x.view(B, T, C)


_ROPE: tuple = (None, None)  # (position_embeddings of the last forward, its cos / sin as rows)


def _kernel_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                          use_cache=False, position_embeddings=None, **kwargs):
    """The lean layer where every step runs on decoding.forward.kernels (a step or a verify of up to
    `row_attention_below` - 1 tokens, no per-head q/k norms): the same arithmetic as
    _lean_layer_forward, with the Python between the kernels cut to what a step needs (a layer's
    Python was ~1/8 of a bf16 step)."""
    f = self._lean
    B, T, C = hidden_states.shape
    if attention_mask is None and T > 1 and f["causal_rows"]:  # a prompt from an empty cache
        attention_mask = causal_mask(T, hidden_states.device)
    if T >= f["row_attention_below"] or (attention_mask is None and T > 1):
        return _lean_layer_forward(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                   position_embeddings, **kwargs)
    ops = f["ops"]
    x = hidden_states.reshape(B * T, C)
    global _ROPE
    rope = _ROPE  # read once: another thread's forward may replace it
    if rope[0] is not position_embeddings:  # once per forward, not per layer
        cos, sin = position_embeddings
        cos, sin = (c.expand(B, T, c.shape[-1]).reshape(B * T, -1).contiguous() for c in (cos, sin))  # [B or 1, T, D]
        rope = _ROPE = (position_embeddings, (cos, sin))
    cos, sin = rope[1]
    cached = past_key_values.layers[f["layer"]] if past_key_values is not None else None
    if f["one_call"] and hasattr(cached, "room") and B * T < f["one_call"]:  # the whole layer in one kernel call
        kb, vb, start, n = cached.room(f["kv_like"] if B == 1 else f["kv_like"].expand(B, -1, -1, -1), T)
        y = ops.decoder_layer(x, cos, sin, kb, vb, start, n, attention_mask, f["weights"], f["qkv"].bias,
                              [B, *f["dims"]], f["norm1"][1], f["norm2"][1], f["scaling"])
        cached.grown(start, n + T)
        return y.view(B, T, C)
    q, k, v = ops.rope_qkv(f["qkv"](ops.add_rms_norm(x, None, *f["norm1"])[1]), cos, sin, B, f["heads"], f["kv_heads"])
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, f["layer"])
    att = ops.row_attention(q, k, v, attention_mask, f["scaling"]).view(B * T, -1)  # mask: >= the keys
    x, h = ops.add_rms_norm(x, f["o"](att), *f["norm2"])
    return (x + f["down"](ops.silu_mul(f["gate_up"](h)))).view(B, T, C)


_CAUSAL: dict = {}


def causal_mask(T: int, device) -> torch.Tensor:
    """[1, 1, T, T] bool, True where a row sees a key: the causal block row_attention takes."""
    key = (T, str(device))
    if key not in _CAUSAL:
        _CAUSAL.clear()  # one prompt length at a time
        _CAUSAL[key] = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    return _CAUSAL[key]


def _one_call(f: dict) -> int:
    """Rows below which the whole layer runs as one `specstop::decoder_layer` call (0: never): its
    four linears on AMX tiles or fp32 panels (the same kernels the lean layer calls one by one,
    so the same result bit for bit), no bias but q/k/v's."""
    lins = [f[k] for k in ("qkv", "o", "gate_up", "down")]
    if any(lin.few is None for lin in lins) or any(lin.bias is not None for lin in lins[1:]):
        return 0
    if all(isinstance(lin.few, quant.QuantWeight) for lin in lins):  # a GGUF's blocks, one form
        return min(f["row_attention_below"], *(lin.small_below for lin in lins)) \
            if len({(lin.few.act, lin.few.isa) for lin in lins}) == 1 else 0
    used = {lin.few.op for lin in lins}
    if used not in ({kernels.ops.amx_linear.default}, {kernels.ops.panel_linear.default}):
        return 0
    return min(f["row_attention_below"], *(lin.small_below for lin in lins))


def _bind(f: dict) -> None:
    ws = [f[k].few for k in ("qkv", "o", "gate_up", "down")]
    packed = [w.packed() if isinstance(w, quant.QuantWeight) else w.w for w in ws]
    f["weights"] = [f["norm1"][0], packed[0], packed[1], f["norm2"][0], packed[2], packed[3]]


def rebind(model: torch.nn.Module) -> None:
    """The one-call layers read their packed weights again (after kernels.gather moved them)."""
    for layer in getattr(getattr(model, "model", None), "layers", None) or ():
        if getattr(layer, "_lean", {}).get("one_call"):
            _bind(layer._lean)


@torch.no_grad()
def make_lean(model: torch.nn.Module, pack=lambda w: None, eager_below: dict | None = None,
              small_below: dict | None = None) -> int:
    """Run every decoder layer of `model` lean; returns how many (0, unchanged, unless all are
    supported). Call on an unpacked model, then `packed.pack_linears` packs the rest (the
    output layer): the fused copies replace the layers' own packed weights. pack(weight): its
    prepacked form or None (packed.pack_weight); eager_below: packed.EAGER_BELOW;
    small_below: dtype -> rows below which the few-row kernel runs (decoding.forward.kernels)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    cfg = getattr(model, "config", None)
    if layers is None or cfg is None or any(why_not(layer, cfg) for layer in layers):
        return 0
    n = 0
    for layer in layers:
        if hasattr(layer, "_lean"):
            continue
        a, m = layer.self_attn, layer.mlp
        dt = a.q_proj.weight.dtype
        kw = {"pack": pack, "eager_below": (eager_below or {}).get(dt, 0), "small_below": (small_below or {}).get(dt, 0)}
        layer._lean = {
            "qkv": _Fused([a.q_proj, a.k_proj, a.v_proj], **kw), "o": _Fused([a.o_proj], **kw),
            "gate_up": _Fused([m.gate_proj, m.up_proj], **kw), "down": _Fused([m.down_proj], **kw),
            "heads": a.q_proj.weight.shape[0] // a.head_dim, "kv_heads": a.k_proj.weight.shape[0] // a.head_dim,
            "inter": m.gate_proj.weight.shape[0], "qk_norm": FAMILIES[type(layer).__name__],
            "fused": kernels.available() and kw["small_below"] > 0,  # the row-wise ops are built
            # steps and verifies attend on the kernel (a prefill: sdpa); $SPECSTOP_BATCH_INVARIANT=0: sdpa
            "row_attention_below": (kernels.attention_rows(dt) + 1) if kw["small_below"] and kernels.attention_rows(dt) else 0,
        }
        f = layer._lean
        on_blocks = isinstance(f["qkv"].few, quant.QuantWeight)
        f["quant_attention"] = on_blocks and not f["fused"] and quant.attends_here(dt)
        f["ops"] = kernels.ops if f["fused"] else None  # the row-wise ops: kernels', quant's, or torch's
        if f["quant_attention"]:  # a GGUF target without the AVX512 kernels: csrc/quant_layer.cpp's (AVX2)
            f["ops"], f["fused"], f["row_attention_below"] = quant.ops, True, QUANT_ROWS
        f["causal_rows"] = on_blocks and (f["row_attention_below"] > 0 or f["quant_attention"])
        if f["causal_rows"] and f["row_attention_below"]:
            # a GGUF's linears take any row count alike: so does the attention, the prompt's
            # causal block included (else a prompt token's keys would round otherwise than the
            # same token's in a verify, and q8 activations make that a whole quantum)
            f["row_attention_below"] = QUANT_ROWS
        f.update(norm1=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                 norm2=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                 layer=a.layer_idx, scaling=a.scaling)
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            lin._lean_fused = True  # computed by the fused copy: pack_linears leaves it alone
        on_kernels = f["row_attention_below"] and not f["qk_norm"]
        f["one_call"] = _one_call(f) if on_kernels else 0
        if f["one_call"]:
            ws = [f[k].few for k in ("qkv", "o", "gate_up", "down")]
            q = [w.kind for w in ws] + [int(ws[0].act == "q8"), ws[0].isa] if isinstance(ws[0], quant.QuantWeight) else []
            f.update(dims=[f["heads"], f["kv_heads"], *(w.n for w in ws), *q],
                     kv_like=a.q_proj.weight.new_empty(1, f["kv_heads"], 1, a.head_dim))
            _bind(f)
        layer.forward = types.MethodType(_kernel_layer_forward if on_kernels else _lean_layer_forward, layer)
        n += 1
    return n


def unmake_lean(model: torch.nn.Module) -> None:
    """Back to transformers' layers."""
    for layer in getattr(getattr(model, "model", None), "layers", None) or ():
        if hasattr(layer, "_lean"):
            del layer._lean, layer.forward
            for lin in layer.modules():
                if hasattr(lin, "_lean_fused"):
                    del lin._lean_fused


def is_lean(model: torch.nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None) or ()
    return any(hasattr(layer, "_lean") for layer in layers)
