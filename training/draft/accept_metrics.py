"""What sampled decoding gets from a draft, and losses that aim at it.

Speculative sampling accepts a token drafted from q at a position whose target distribution is
p with probability sum_x min(p(x), q(x)) (Leviathan et al.), so that sum, under the serving
temperature's warping of both p and q, is the expected acceptance of one draft step; top-1
agreement is what greedy decoding gets. Here p is the target's distribution over the draft
vocabulary as the feature cache keeps it (its top-k log-probs, renormalised after warping: the
mass beyond the top 32 at T = 0.7 is negligible) and q the head's over the same vocabulary.

sd_rounds / walk_sd: the greedy sd chain walked along a teacher-forced continuation (tokens per
target call), which the trainer's validation and training.bench.head both report.

Losses (model.loss): soft_ce (cross-entropy to the target's soft labels, the default) |
lk_alpha (-log of the mean expected acceptance, SpecForge's "alpha" LK loss) | lk_lambda
(w * soft CE + (1 - w) * (1 - acceptance), w = kl_scale * exp(-kl_decay * acceptance): CE
leads while acceptance is low, acceptance takes over as it rises; SpecForge's "lambda").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("soft_ce", "lk_alpha", "lk_lambda")


def expected_acceptance(lab_ids: torch.Tensor, lab_logp: torch.Tensor, lq: torch.Tensor,
                        temperature: float = 0.7) -> torch.Tensor:
    """[n] sum_x min(p_T(x), q_T(x)). lab_ids / lab_logp [n, k]: the target's top-k draft
    indices and log-probs (-inf where fewer than k); lq [n, V]: the head's log-probs (any
    normalisation: only their differences count)."""
    if temperature <= 0:
        raise ValueError("expected acceptance needs a sampling temperature > 0")
    p = torch.softmax(lab_logp.float() / temperature, -1).nan_to_num(0.0)
    q = F.log_softmax(lq.float() / temperature, -1).gather(1, lab_ids).exp()
    return torch.minimum(p, q).sum(-1)


def combine(kind: str, ce: torch.Tensor, accept: torch.Tensor, weight: torch.Tensor,
            kl_scale: float = 1.0, kl_decay: float = 3.0) -> torch.Tensor:
    """The step's loss from per-position soft CE and acceptance, averaged with `weight` (the
    positions whose target argmax is inside the draft vocabulary)."""
    n = weight.sum().clamp_min(1)
    ce_mean = (ce * weight).sum() / n
    if kind == "soft_ce":
        return ce_mean
    alpha = (accept * weight).sum() / n
    if kind == "lk_alpha":
        return -torch.log(alpha.clamp_min(1e-6))
    if kind == "lk_lambda":
        w = kl_scale * torch.exp(-kl_decay * alpha.detach())
        return w * ce_mean + (1 - w) * (1 - alpha)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)} (got {kind!r})")


def sd_rounds(lead: list[int], valid: list[bool], start: int) -> tuple[int, int]:
    """(rounds, committed tokens) of a greedy `sd` chain walking a continuation: the round at
    index t accepts lead[t] drafts (its leading run of right steps) plus the target's own token,
    so the next round starts at t + lead[t] + 1. Rounds start right after a rejection, where the
    head is weaker than on average: this, not the per-position mean, is what decoding sees (the
    two are equal only if misses were independent). Stops at the first index whose deepest step
    has no label."""
    rounds = tokens = 0
    t = start
    while 0 <= t < len(valid) and valid[t]:
        rounds, tokens = rounds + 1, tokens + lead[t] + 1
        t += lead[t] + 1
    return rounds, tokens


def walk_sd(hits: list[torch.Tensor], valid: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """[B, 2] (rounds, tokens) of a greedy chain of len(hits) drafts walked along each row.
    hits[j] [B, T]: step j+1's top-1 at index t is right; valid [B, T]: the deepest step has a
    label at t; starts: each row's first round (the index before its first label)."""
    run, lead = None, torch.zeros(valid.shape, dtype=torch.long)
    for hit in hits:  # lead[t]: how many leading steps at t are all right
        run = hit if run is None else run & hit
        lead += run.long()
    return torch.tensor([sd_rounds(lead[i].tolist(), valid[i].tolist(), int(starts[i]))
                         for i in range(len(starts))], dtype=torch.float64).reshape(-1, 2)
