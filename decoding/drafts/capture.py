"""The target's residual stream at the input of chosen layers (EAGLE-3's low / middle / high
features), captured with forward PRE-hooks: what a feature head reads, for decoding
(decoding.drafts.feature_proposer) and for training (training.head.cache)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from decoding.models.target_layout import decoder_layers


class AuxCapture:
    """States captured by `capture_aux`: `states[i]` is layer i's input of the latest forward."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.states: dict[int, torch.Tensor] = {}

    def aux(self) -> torch.Tensor:
        missing = [i for i in self.layers if i not in self.states]
        if missing:
            raise RuntimeError(f"no target forward captured layers {missing}")
        return torch.cat([self.states[i] for i in self.layers], dim=-1)


@contextmanager
def capture_aux(target, layers):
    """Forward PRE-hooks on target layers `layers`: record the residual stream at their input."""
    cap = AuxCapture(layers)
    blocks = decoder_layers(target)
    bad = [i for i in cap.layers if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"target has {len(blocks)} layers; cannot capture layers {bad}")

    def hook(i, _module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        cap.states[i] = x.detach()

    handles = [blocks[i].register_forward_pre_hook(lambda mod, a, k, i=i: hook(i, mod, a, k), with_kwargs=True)
               for i in cap.layers]
    # a static / graph forward (decoding.forward.static) pads its rows and a replay runs no hook:
    # it publishes its own taps, cut to the real rows, which replace what the hooks saw
    target.__dict__.pop("_specstop_taps", None)
    target._specstop_capturing = cap.layers
    try:
        yield cap
    finally:
        for h in handles:
            h.remove()
        del target._specstop_capturing
        taps = target.__dict__.pop("_specstop_taps", None)
        if taps:
            cap.states.update({i: taps[i].detach() for i in cap.layers})
