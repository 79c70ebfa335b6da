"""Where a target keeps what a feature (EAGLE-3) head reads and copies: its decoder layers, its
input embedding function, its final norm and its output layer.

One small adapter for every family instead of `.model.layers` / `.model.norm` assumptions:
Llama, Mistral, Qwen2/3, Mixtral, Phi3 and Gemma 1/2/3 keep them in `model.model`, GPT-NeoX in
`gpt_neox` (final_layer_norm). Two things differ in value, not in place, so they are MEASURED on
the target rather than looked up by family:

- the embedding function: Gemma multiplies the token embedding by sqrt(hidden) (its
  ScaledWordEmbedding), Granite by `embedding_multiplier`; a probe forward captures the input
  of layer 0 and must equal (token embedding) * one constant. A target whose layer-0 input is
  anything else (GPT-2's learned position embeddings, an embedding norm) is refused: an
  EAGLE-3 head embeds tokens alone.
- the final norm's effective weight: Gemma's RMSNorm applies (1 + w), Llama's w; the norm is
  applied to a vector of ones (rms 1), which gives w_eff / sqrt(1 + eps) for either.

A target whose layers cannot be found is refused with one ModelError line naming its
architecture. The output layer is the model's own `get_output_embeddings()` plus the
final-logit soft-capping Gemma 2 applies outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from decoding.models.errors import ModelError

# attribute paths under the model's base_model (its trunk), tried in order
_LAYERS = ("layers", "h", "decoder.layers")
_NORMS = ("norm", "final_layer_norm", "ln_f", "final_norm", "decoder.final_layer_norm")
_LLAMA_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                "post_attention_layernorm")


def _get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def architecture(model) -> str:
    cfg = getattr(model, "config", None)
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return f"{archs[0]} ({getattr(cfg, 'model_type', '?')})"


@dataclass
class TargetLayout:
    """What a feature head needs from one loaded target."""

    trunk: nn.Module
    """The decoder stack without the output layer (returns last_hidden_state, final norm applied)."""
    layers: nn.ModuleList
    norm: nn.Module
    embed: nn.Module
    embed_scale: float
    """The target's layer-0 input is embed(ids) * embed_scale (measured)."""
    lm_head: nn.Module
    softcap: float | None
    arch: str

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its trunk's output (soft-capping included)."""
        out = self.lm_head(hidden)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def norm_weight(self) -> torch.Tensor:
        """The final norm's effective per-channel weight (Gemma's 1 + w, Llama's w)."""
        return effective_norm_weight(self.norm)

    def llama_like_layer(self, i: int = -1) -> bool:
        """Layer i has Llama's sub-modules, silu and no sandwich norms: the only layout whose
        weights the head's midlayer can start from (Gemma 2/3: gelu and four norms; Phi3:
        fused projections; Mixtral: experts)."""
        layer, cfg = self.layers[i], getattr(self.trunk, "config", None)
        act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
        return (all(_get(layer, n) is not None for n in _LLAMA_LAYER) and act == "silu"
                and _get(layer, "pre_feedforward_layernorm") is None)


@torch.no_grad()
def effective_norm_weight(norm: nn.Module) -> torch.Tensor:
    norm = norm if hasattr(norm, "weight") else getattr(norm, "norm", norm)  # models._UpcastNorm
    if isinstance(norm, nn.LayerNorm):  # the head's norm is an RMSNorm: its scale is a start
        return norm.weight.detach().float()
    w = getattr(norm, "weight", None)
    if w is None:
        raise ModelError(f"the final norm {type(norm).__name__} has no weight")
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0)) or 0.0)
    ones = torch.ones(1, w.shape[-1], dtype=torch.float32, device=w.device)
    return (norm.float()(ones) if w.dtype != torch.float32 else norm(ones))[0].float() * math.sqrt(1 + eps)


def target_layout(target) -> TargetLayout:
    """The layout of `target` (cached on the model); ModelError when it cannot host a head."""
    cached = getattr(target, "_specstop_layout", None)
    if cached is not None:
        return cached
    arch = architecture(target)
    base = getattr(target, "base_model", None)
    trunk = base if isinstance(base, nn.Module) and base is not target else None
    layers = next((x for x in (_get(trunk, p) for p in _LAYERS) if isinstance(x, nn.ModuleList)), None) \
        if trunk is not None else None
    norm = next((x for x in (_get(trunk, p) for p in _NORMS) if isinstance(x, nn.Module)), None) \
        if trunk is not None else None
    embed = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    missing = [n for n, x in (("decoder layers", layers), ("final norm", norm), ("token embedding", embed),
                              ("output layer", head)) if x is None]
    if missing:
        raise ModelError(f"feature heads do not support {arch}: cannot find its {', '.join(missing)}")
    layout = TargetLayout(trunk, layers, norm, embed, 1.0, head,
                          getattr(target.config, "final_logit_softcapping", None), arch)
    layout.embed_scale = _measure_embed_scale(target, layout)
    target._specstop_layout = layout
    return layout


def decoder_layers(target) -> nn.ModuleList:
    return target_layout(target).layers


@torch.no_grad()
def _measure_embed_scale(target, layout: TargetLayout) -> float:
    """c such that layer 0's input is embed(ids) * c, from one short probe forward."""
    w = layout.embed.weight
    n = min(8, w.shape[0])
    ids = torch.arange(1, n + 1, device=w.device)[None] % w.shape[0]
    got = {}

    def hook(_m, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    handle = layout.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        layout.trunk(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    x, e = got["x"][0].double(), w[ids[0]].double()
    scale = float((x * e).sum() / (e * e).sum().clamp_min(1e-30))
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    if not torch.allclose(x, e * scale, rtol=tol, atol=tol * float(x.abs().max())):
        raise ModelError(f"feature heads do not support {layout.arch}: its first layer's input is not "
                         "its token embedding times a constant (position embeddings or an embedding "
                         "norm), and an EAGLE-3 head embeds tokens alone")
    declared = getattr(layout.embed, "scalar_embed_scale", None)  # Gemma's exact sqrt(hidden)
    for exact in (1.0, declared):
        if exact is not None and abs(scale - exact) <= tol * exact:
            return float(exact)
    return scale
