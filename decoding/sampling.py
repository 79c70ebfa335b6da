"""Turning logits into the distributions that drafting and verification use.

Temperature and top-p are applied to BOTH the target (p) and the draft (q) before any
acceptance rule: the rule then reproduces the warped target distribution exactly.
"""

from __future__ import annotations


import torch

from decoding.options import MIN_TEMPERATURE, SamplingConfig  # noqa: F401 (re-exported)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index at ties, as torch.argmax). On a CPU in float32 through
    numpy: torch's CPU argmax over a 49k vocabulary is scalar code, ~65 us a row against ~3, and a
    verify reads one row per tree node."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Float32 probabilities over the last dim after temperature and top-p.

    Greedy mode returns the plain softmax (T = 1): it is what confidence-based stop rules
    and decider features read; greedy acceptance itself only uses the argmax.
    """
    logits = logits.float()
    if not cfg.greedy:
        logits = logits / cfg.temperature
    probs = torch.softmax(logits, dim=-1)
    if cfg.greedy or cfg.top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # keep a token while the mass strictly before it is < top_p (the top token always stays)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n uniforms in [0, 1), drawn on the generator's own device (a CUDA generator cannot
    fill a tensor on the default CPU device) and returned as Python floats."""
    device = generator.device if generator is not None else None
    return torch.rand(n, generator=generator, device=device).tolist()


def multinomial(probs: torch.Tensor, n: int, generator: torch.Generator | None,
                replacement: bool = False) -> list[int]:
    """torch.multinomial on the generator's device (probs are moved there if they differ)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, n, replacement=replacement, generator=generator).tolist()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return multinomial(probs, 1, generator)[0]


def draw_candidates(
    probs: torch.Tensor, k: int, cfg: SamplingConfig, replacement: bool, generator
) -> tuple[list[int], list[bool]]:
    """k candidate tokens from one distribution: top-k when greedy, else sampled.

    Without replacement, torch.multinomial draws sequentially and renormalises after each
    draw, exactly the q-update the acceptance rule assumes. If fewer than k tokens have
    mass (top-p), the missing slots are returned invalid and are never accepted.
    """
    if cfg.greedy:
        return probs.topk(k).indices.tolist(), [True] * k
    if replacement:
        return multinomial(probs, k, generator, replacement=True), [True] * k
    n = min(k, int((probs > 0).sum()))
    toks = multinomial(probs, n, generator)
    return toks + [toks[0]] * (k - n), [True] * n + [False] * (k - n)
