"""What a feature-head re-distillation run reads (training.head.redistill): its YAML's fields, one
flag each (`python -m training.head.redistill --config configs/redistill_eagle3.yaml`): the logged
prompts and their held-out share, the champion, the training's base config and time box, how the
corpus is written, the promotion gate's margins and the serve gate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RedistillConfig:
    new_prompts: str = "data/logged"
    """Directory of JSONL files of logged prompts ({"prompt": ..., optional "id", "kind"})."""
    work: str = "runs/redistill"
    """Versioned run directories live here."""
    draft: str = "checkpoints/drafts/smollm2-135m-eagle3"
    """The champion: an exported feature head. Promotion replaces this directory."""
    target: str | None = None
    """Target model directory (None = the embedded SmolLM2); the champion must be its own."""
    heldout_fraction: float = 0.25
    """Share of the prompts (by a hash of their id) never trained on: the gate judges on them."""
    distill_config: str = "configs/distill_eagle3.yaml"
    """Base training config (model, data, trainer); the run pins target, corpora, vocabulary,
    layers, warm start, output paths and the time box."""
    distill_overrides: list[str] = field(default_factory=list)
    """Extra training.draft.distill flags, e.g. ["--model.lr", "5e-5"] (each flag and value apart)."""
    extra_corpora: list[str] = field(default_factory=list)
    """Committed corpora trained on as well (keeps the head from forgetting them)."""
    max_minutes: float | None = 30.0
    """Training time box (trainer.max_time); None = the base config's."""
    max_steps: int | None = None
    """Training step cap (trainer.max_steps); None = the base config's."""
    dtype: str = "bfloat16"
    """Dtype the target writes the continuations in (as configs/corpus.yaml)."""
    temperature: float = 0.7
    """Sampling temperature of the training continuations (held-out ones are greedy)."""
    max_new_tokens: int = 128
    batch_size: int = 16
    """Prompts the target continues together when writing the new corpus."""
    shard_size: int = 64
    """Rows per corpus shard file (a resumed run redoes at most one shard)."""
    depth: int = 4
    """Greedy chain depth the gate scores (teacher-forced steps 1..depth)."""
    margin: float = 0.02
    """Promote when the challenger's mean accepted length >= champion's * (1 + margin) ..."""
    step1_tolerance: float = 0.01
    """... and its step-1 agreement is at most this much below the champion's."""
    threads: int | None = None
    """torch intra-op threads (None = torch's default)."""
    serve_check_python: str | None = ".venv-vllm/bin/python"
    """vLLM's python (make serve-check): a challenger about to be promoted must serve there as in
    specstop (training/export/gate.py); absent = skipped and recorded, null = off."""
    serve_check_prompts: int = 4
    """Held-out prompts the serve gate runs."""
    serve_check_tokens: int = 48
    """New tokens each of the serve gate's prompts generates."""
