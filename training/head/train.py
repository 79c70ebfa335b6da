"""Train the feature (EAGLE-3) head and export it: what `python -m training.distill` runs for a
config whose `run.kind` is eagle3 (configs/distill_eagle3.yaml).

    python -m training.distill --config configs/distill_eagle3.yaml [--trainer.max_time ...]

LightningCLI (any --trainer.*, --model.*, --data.* override). It resumes from the run's
last.ckpt (the ModelCheckpoint dirpath, e.g. runs/distill/<name>/checkpoints/, git-ignored)
when one exists, stops at trainer.max_time and exports the best checkpoint (highest
validation step-1 agreement) to `<run.drafts>/<run.name>/` in specstop's own format.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from training.head.data import FeatureDataModule
from training.head.module import FeatureDistillModule


@dataclass
class RunConfig:
    kind: str = "eagle3"
    """Which trainer training.draft.distill dispatches to (this one: eagle3)."""
    name: str = "smollm2-135m-eagle3"
    """Exported head name: <drafts>/<name>/."""
    drafts: str = "checkpoints/drafts"
    """Where the exported directory goes."""
    export: bool = True
    """Export the best checkpoint after fit."""
    resume: bool = True
    """Continue from <checkpoint dirpath>/last.ckpt when it exists."""
    threads: int | None = None
    """torch intra-op threads (None = torch's default)."""
    dtype: str = "bfloat16"
    """Dtype of the exported weights: bfloat16 | float16 | float32 (16-bit halves the size of
    the committed head; decoding casts to the run's dtype)."""


def load_feature_module(ckpt) -> FeatureDistillModule:
    """Rebuild the module from a checkpoint, reading only tensors and plain types (the head's
    token embeddings are the target's: loaded from model.target, never stored)."""
    from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    hp = dict(state["specstop_hparams"])
    head_cfg, window = hp.pop("head"), hp.pop("trained_window", None)
    module = FeatureDistillModule(**hp)
    if window is not None:
        module.hp["trained_window"] = window
    cfg = FeatureDraftConfig.from_dict(head_cfg)
    module.head = FeatureDraft(cfg, module.target().get_input_embeddings().weight)
    module.hp["head"], module.layers = head_cfg, list(cfg.aux_layers)
    module.load_state_dict(state["state_dict"])
    module.freeze()
    return module


def export(module: FeatureDistillModule, out: Path, meta: dict, dtype: str = "float32") -> Path:
    """specstop's own feature-draft checkpoint (decoding.drafts.io: atomic, target-pinned)."""
    from decoding.drafts import io as feature_io
    from decoding.models import DTYPES

    head = module.head.to(DTYPES[dtype]).eval()
    return feature_io.save_feature_draft(head, out, module.target(), meta | {"dtype": dtype})


def fit(argv: list[str] | None) -> None:
    from training.config_flags import ckpt_metrics, lightning_cli, relative_path, usage_error
    from training.corpus.teacher import target_fingerprint

    run, trainer, module, data, cb, last = lightning_cli(FeatureDistillModule, FeatureDataModule, RunConfig, argv)
    if data.target != module.hp["target"]:
        usage_error("data.target and model.target must name the same target")
    if run.dtype not in ("bfloat16", "float16", "float32"):
        usage_error(f"run.dtype must be bfloat16, float16 or float32 (got {run.dtype!r})")
    try:
        trainer.fit(module, datamodule=data,
                    ckpt_path=str(last) if run.resume and last.exists() else None)
    except ValueError as e:  # wrong target, nothing cached, bad settings: a config error
        usage_error(str(e))
    if not run.export or trainer.global_rank != 0:
        return
    best = cb.best_model_path or str(last)
    # decoding.drafts.io records the target's models.fingerprint; the corpus identity goes beside it
    meta = {"corpus_target": target_fingerprint(module.hp["target"]),
            "data": {"corpora": data.corpora, "train_positions": data.positions(),
                     "vocab_sha256": data.vocab.sha256(), "vocab_coverage": data.vocab.coverage,
                     # the longest trained row (prompt tail + completion): exports record it
                     "window": max(r["n"] for r in data.train_rows)},
            "training": module.hp | {"checkpoint": relative_path(best)},
            "metrics": {"validation": ckpt_metrics(best)}}
    out = export(load_feature_module(best), Path(run.drafts) / run.name, meta, run.dtype)
    print(f"distill: exported {best} -> {out}", file=sys.stderr)
