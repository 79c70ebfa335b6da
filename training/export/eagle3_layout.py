"""Can a serving engine's EAGLE-3 head compute what ours computes, for this target's layout?

The serving layout (vLLM's llama_eagle3.py, SGLang's llama_eagle3) embeds draft tokens with a
plain embedding table (the target's embed_tokens, shared, or its own copy): no Gemma
normalizer, no Granite multiplier. Our head embeds with the target's own function,
embedding * c (decoding.models.target_layout measures c). The head's first and only use of that
embedding is `input_layernorm`, an RMSNorm, which cancels c up to its eps:
    rms(c e) -> c e / sqrt(c^2 ms(e) + eps)  vs  e / sqrt(ms(e) + eps)  (ms: mean square)
so the engine's input differs by the factor sqrt((ms + eps) / (ms + eps / c^2)) per token.
Export is allowed when that factor is within TOLERANCE of 1 for every token (below bf16's
resolution), refused in one line otherwise. The format has no field for c; `from_eagle3`
takes it from the target again.
"""

from __future__ import annotations

import torch

from decoding.models import ModelError

TOLERANCE = 1e-3
"""Largest relative change of the head's normed embedding allowed (bf16's step is 2^-8)."""


@torch.no_grad()
def scale_deviation(embed_weight: torch.Tensor, scale: float, eps: float) -> float:
    """Largest relative change, over tokens, of rmsnorm(embedding) when the scale is dropped."""
    ms = embed_weight.double().pow(2).mean(-1)
    ms = ms[ms > 0]  # an all-zero row (padding) is zero either way
    if not ms.numel() or scale == 1.0:
        return 0.0
    return float(((ms + eps) / (ms + eps / scale**2)).sqrt().sub(1).abs().max())


def check_exportable(draft) -> None:
    """ModelError when the engines' EAGLE-3 head would compute something else than `draft`."""
    c = draft.config
    if c.embed_scale == 1.0:
        return
    if draft.embed_weight is None:
        raise ModelError("the head has no target embeddings attached: cannot check its embedding scale")
    dev = scale_deviation(draft.embed_weight, c.embed_scale, c.rms_norm_eps)
    if dev > TOLERANCE:
        raise ModelError(f"this head embeds tokens scaled by {c.embed_scale:g} (its target's embedding "
                         f"function); serving engines' EAGLE-3 heads embed unscaled, which its input norm "
                         f"cancels only to {dev:.1e} (> {TOLERANCE:g}) here: not exportable to eagle3")
