"""A draft for a loaded target, either kind: a feature head, checked against the target's
fingerprint as it loads (decoding.drafts.io), or a stand-alone causal LM with its tokenizer,
checked against the target's vocabulary and tokenizer (decoding.models.pair)."""

from __future__ import annotations

from pathlib import Path

import torch

from decoding.drafts.io import draft_kind, load_feature_draft
from decoding.drafts.pruned import load_model
from decoding.forward import quant
from decoding.models.pair import check_pair
from decoding.models.weights import load_tokenizer


def load_draft(ddir: Path, target: torch.nn.Module):
    """(the draft at `ddir` in the target's dtype and on its device, its tokenizer or None for a
    feature head, which reads the target's)."""
    dtype = str(target.dtype).removeprefix("torch.")
    device = str(target.device)
    if draft_kind(ddir) == "eagle3":
        d = load_feature_draft(ddir, target, dtype, device)
        if quant.quantized(target):  # a GGUF target's head runs on blocks too
            quant.quantize_head(d)
        return d, None
    return load_model(ddir, dtype, device), load_tokenizer(ddir)


def check_draft(target, draft, tokenizer, draft_tokenizer) -> None:
    """A stand-alone draft must share the target's vocabulary and tokenizer; a feature head
    (no tokenizer of its own) was checked by the target's fingerprint as it loaded."""
    if draft_tokenizer is not None:
        check_pair(target, draft, tokenizer, draft_tokenizer)
