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


from training.head.data import FeatureDataModule
from training.head.module import FeatureDistillModule, load_feature_module  # noqa: F401  (re-exported)


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
    chunks: str | None = None
    """Root of the committed training chunks (e.g. checkpoints/training): the run writes
    <chunks>/<name>/latest (weights, optimizer, schedule, data position; training.head.chunks)
    and continues from it on a fresh clone. None: no chunks (runs/ only, lost with the machine)."""
    commit_every_minutes: float | None = 30.0
    """With chunks: write the latest chunk every this many minutes of training (and always at
    the session's end). None: only at the end."""
    session_minutes: float | None = None
    """With chunks: stop this session after this many minutes of training, writing a chunk (the
    run goes on in the next session; trainer.max_time and max_steps bound the whole run)."""
    session_steps: int | None = None
    """Stop this session after this many optimizer steps, writing a chunk (smoke runs, tests)."""
    chunk_moments: str = "float32"
    """AdamW moments in a chunk: float32 (an exact continuation) | bfloat16 (a third smaller
    chunk, the continuation then differs by the moments' rounding)."""
    chunk_shard_mib: float = 15.0
    """Target size of a chunk's tensor files (a larger tensor gets a file of its own: 18.9 MB for
    the shipped head's lm_head; git hosts refuse files over 100 MB)."""
    heldout_rows: int = 64
    """Rows of the validation slice each chunk is scored on, beside `baseline` (0: no scores,
    no best/ export)."""
    baseline: str | None = "checkpoints/drafts/smollm2-135m-eagle3"
    """The shipped head each chunk is compared with on the same held-out rows (paired)."""


def export(module: FeatureDistillModule, out: Path, meta: dict, dtype: str = "float32") -> Path:
    """specstop's own feature-draft checkpoint (decoding.drafts.io: atomic, target-pinned)."""
    from decoding.drafts import io as feature_io
    from decoding.models import DTYPES

    head = module.head.to(DTYPES[dtype]).eval()
    return feature_io.save_feature_draft(head, out, module.target(), meta | {"dtype": dtype})


def with_chunks(run: RunConfig, trainer, module, data, last: Path) -> str | None:
    """Add the chunk writer; the checkpoint to continue from (last.ckpt or the committed chunk,
    whichever is further). The data is set up first: a chunk's identity includes its vocabulary."""
    from dataclasses import asdict

    from training.head.chunk_run import LATEST, ChunkWriter, resume_path
    from training.head.chunks import identity, manifests

    if run.chunk_moments not in ("float32", "bfloat16"):
        raise ValueError(f"run.chunk_moments must be float32 or bfloat16 (got {run.chunk_moments!r})")
    data.prepare_data()
    data.setup("fit")
    ident = identity(module, data, trainer)
    folder = Path(run.chunks) / run.name
    ckpt = resume_path(folder / LATEST, last, ident) if run.resume else None
    meta = {"run": asdict(run), "corpora_manifests": manifests(data.corpora),
            "train_rows": len(data.train_rows), "train_positions": data.positions()}
    trainer.callbacks.append(ChunkWriter(
        folder, ident, meta, run.commit_every_minutes, run.session_minutes, run.session_steps, run.chunk_moments,
        run.chunk_shard_mib, run.heldout_rows, run.baseline,
        log=lambda m: print(f"distill: {m}", file=sys.stderr, flush=True)))
    return ckpt


def fit(argv: list[str] | None) -> None:
    from training.config_flags import ckpt_metrics, lightning_cli, relative_path, usage_error
    from training.corpus.teacher import target_fingerprint

    run, trainer, module, data, cb, last = lightning_cli(FeatureDistillModule, FeatureDataModule, RunConfig, argv)
    if data.target != module.hp["target"]:
        usage_error("data.target and model.target must name the same target")
    if run.dtype not in ("bfloat16", "float16", "float32"):
        usage_error(f"run.dtype must be bfloat16, float16 or float32 (got {run.dtype!r})")
    try:
        ckpt = with_chunks(run, trainer, module, data, last) if run.chunks else (
            str(last) if run.resume and last.exists() else None)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    except ValueError as e:  # wrong target, nothing cached, a foreign chunk, bad settings: a config error
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
