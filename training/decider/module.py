"""LightningModule around `decoding.decider.policy.DeciderNet`: BCE on soft or hard labels.

The network is built in `setup()` from the datamodule (hidden size, input standardisation
fitted on TRAIN rows only, class-balance ratio), so the same YAML works for every kind.
"""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import torch
import torch.nn.functional as Fn

from decoding.decider.policy import KINDS, DeciderConfig, DeciderNet

from training.decider.metrics import roc_auc


class DeciderModule(L.LightningModule):
    def __init__(self, kind: str = "mlp11", lr: float = 1e-3, weight_decay: float = 0.0):
        """
        Args:
            kind: mlp11 (paper's 11 features, 11->44->1), hidden (draft hidden state,
                H->512->256->1), logistic (all features -> 1), mlp (all features -> 64 -> 1),
                hybrid (all features and the hidden state, F+H->256->64->1).
            lr: Adam learning rate.
            weight_decay: Adam weight decay.
        """
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"model.kind must be one of {KINDS} (got {kind!r})")
        self.save_hyperparameters()
        self.kind, self.lr, self.weight_decay = kind, lr, weight_decay
        self.net: DeciderNet | None = None
        self.pos_weight = 1.0
        self.logit_shift = 0.0
        self._val: list[tuple[torch.Tensor, torch.Tensor]] = []

    # --- construction from the data ------------------------------------------------------
    def build(self, dm) -> None:
        """Create the net for `dm` (a TraceDataModule) and fit its input standardisation."""
        cfg = DeciderConfig(kind=self.kind, hidden_size=dm.hidden_size, label=dm.label)
        net = DeciderNet(cfg)
        feats, hidden = dm.train_inputs()
        x = net.select(feats, hidden).double()
        std = x.std(0)
        net.mean.copy_(x.mean(0).float())
        # constant inputs (e.g. depth on a depth-1 collection) must not divide by zero
        net.std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)).float())
        self.net = net
        ratio = dm.prior_ratio() if dm.balance != "none" else 1.0
        self.pos_weight = ratio if dm.balance == "pos_weight" else 1.0
        # balancing multiplies the odds of a positive by `ratio`; subtracting log(ratio) from
        # the logits at export restores calibrated probabilities (prior-shift correction)
        self.logit_shift = math.log(ratio) if ratio > 0 else 0.0

    def setup(self, stage: str) -> None:
        if self.net is None:
            self.build(self.trainer.datamodule)

    def calibrated_net(self) -> DeciderNet:
        """The net with the class-balancing prior shift folded into its last bias."""
        if self.logit_shift:
            with torch.no_grad():
                self.net.net[-1].bias.sub_(self.logit_shift)
            self.logit_shift = 0.0
        return self.net.eval()

    # --- training ------------------------------------------------------------------------
    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["features"], batch.get("hidden"))

    def _loss(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        pw = torch.tensor(self.pos_weight, device=logits.device) if self.pos_weight != 1.0 else None
        return Fn.binary_cross_entropy_with_logits(logits, label, pos_weight=pw)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(self(batch), batch["label"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch["label"]),
                 sync_dist=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self(batch)
        loss = self._loss(logits, batch["label"])
        self.log("val_loss", loss, on_epoch=True, batch_size=len(batch["label"]), sync_dist=True)
        self._val.append((torch.sigmoid(logits).detach(), batch["target"]))

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        p = torch.cat([a for a, _ in self._val])
        t = torch.cat([b for _, b in self._val])
        self._val.clear()
        # every rank holds a (padded, equal-sized) shard of val: gather before scoring
        if self.trainer.world_size > 1:
            p, t = self.all_gather(p).reshape(-1), self.all_gather(t).reshape(-1)
        keep = t >= 0
        auc = roc_auc(t[keep].cpu().numpy(), p[keep].cpu().numpy())
        # identical on every rank; sync_dist only keeps Lightning's DDP check quiet
        self.log("val_auc", float(np.nan_to_num(auc, nan=0.5)), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def load_best(self, path: str) -> None:
        """Restore a ModelCheckpoint file without unpickling arbitrary objects."""
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        self.load_state_dict(ckpt["state_dict"])
