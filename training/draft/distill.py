"""Train (distil) a draft for the target, then export it as an HF directory.

    python -m training.distill --config configs/distill_draft.yaml [--trainer.max_time ...]
    python -m training.distill export --ckpt runs/distill/NAME/checkpoints/best.ckpt --name NAME

Training is LightningCLI (any `--trainer.*`, `--model.*`, `--data.*` override works, also
`--trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu`). It resumes from the
run's last.ckpt when one exists, stops at trainer.max_time, and exports the best checkpoint
(highest validation top-1 agreement) to `checkpoints/drafts/<name>/`: config.json,
model.safetensors (16-bit, a stock LlamaForCausalLM), the target's tokenizer files and
specstop_draft.json (kept head ids, target fingerprint, data, losses, metrics). The directory
is written to a temp dir and renamed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from decoding.options import add_option

from training.draft.data import CorpusDataModule
from training.draft.module import DistillModule, DraftConfig
from training.config_flags import ckpt_metrics, lightning_cli, relative_path, usage_error  # noqa: F401  (re-exported)
from training.corpus.teacher import target_fingerprint  # noqa: F401  (re-exported)
from training.swap import replace_dir
from training.shards import sha256_file

METADATA = "specstop_draft.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


@dataclass
class RunConfig:
    name: str = "smollm2-135m-draft"
    """Exported draft name: checkpoints/drafts/<name>/."""
    drafts: str = "checkpoints/drafts"
    """Where the exported draft directory goes."""
    export: bool = True
    """Export the best checkpoint after fit (rank 0)."""
    resume: bool = True
    """Continue from runs/distill/<name>/checkpoints/last.ckpt when it exists."""
    threads: int | None = None
    """torch intra-op threads per process (None = torch's default)."""
    threads_file: str | None = None
    """Optional file holding a thread count, re-read every 20 steps: a long run can take
    over cores that free up (e.g. when corpus generation ends) without a restart."""
    dtype: str = "bfloat16"
    """16-bit dtype of the exported weights: bfloat16 | float16."""


def export_draft(module: DistillModule, out: Path, meta: dict, dtype: str = "bfloat16") -> Path:
    """Write the (merged) draft + tokenizer + metadata to `out` atomically."""
    from decoding.models import resolve_model_dir

    adapter = module.draft if module.cfg.lora else None  # kept, and merged for serving
    return write_draft(module.draft, out, meta, resolve_model_dir(module.target_path), dtype, adapter)


def write_draft(model, out: Path, meta: dict, tokenizer_dir: Path, dtype: str = "bfloat16",
                adapter=None) -> Path:
    """An HF draft directory (a stock LlamaForCausalLM in 16-bit, the target's tokenizer files,
    our metadata + the kept head ids), written to a temp dir and swapped in: readers see the
    old draft or the new one."""
    from decoding.drafts.format import DRAFT_SCHEMA, dumps_meta
    from decoding.drafts.pruned import save_draft_weights
    from decoding.models import make_shareable

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        if adapter is not None:
            adapter.save_pretrained(tmp / "adapter")
            model = adapter.merge_and_unload()  # note: folds the adapter into the module's draft
        model = model.to({"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]).eval()
        head_ids = save_draft_weights(model, tmp)
        for f in TOKENIZER_FILES:
            if (tokenizer_dir / f).exists():
                shutil.copy2(tokenizer_dir / f, tmp / f)
        meta = {k: v for k, v in meta.items() if k != "head_ids"} | {"schema_version": DRAFT_SCHEMA}
        (tmp / METADATA).write_text(dumps_meta(meta | ({"head_ids": head_ids} if head_ids else {})))
        make_shareable(tmp)
        replace_dir(tmp, out)  # one atomic swap: a reader never finds the path empty
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_module(ckpt: str | os.PathLike) -> DistillModule:
    """Rebuild the module from a checkpoint, reading only tensors and plain types."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    hp = dict(state["specstop_hparams"])
    hp["draft"] = DraftConfig(**hp["draft"])
    module = DistillModule(**hp)
    module.load_state_dict(state["state_dict"])
    module.initialised = True
    return module


def build_metadata(module: DistillModule, ckpt: str, corpus: str | None, metrics: dict,
                   train_tokens: int | None, extra_corpora: list[str] = ()) -> dict:
    from decoding.drafts.format import DRAFT_SCHEMA
    from decoding.models import output_token_ids

    def manifest_sha(c: str | None) -> str | None:
        man = Path(c) / "manifest.json" if c else None
        return sha256_file(man) if man and man.exists() else None

    head = output_token_ids(module.base())
    return {
        "kind": "specstop-draft", "schema_version": DRAFT_SCHEMA,
        "target": target_fingerprint(module.target_path),
        "data": {"corpus": corpus, "corpus_manifest_sha256": manifest_sha(corpus),
                 "extra_corpora": {c: manifest_sha(c) for c in extra_corpora},
                 "train_completion_tokens": train_tokens},
        "training": {k: v for k, v in module.hp.items()} | {"checkpoint": relative_path(ckpt)},
        "draft": {"params": sum(p.numel() for p in module.base().parameters()),
                  "head_size": None if head is None else int(head.numel())},
        "metrics": {"validation": metrics},
    }


class ThreadsFromFile(Callback):
    def __init__(self, path: str, every: int = 20):
        self.path, self.every = Path(path), every

    def on_train_batch_start(self, trainer, module, batch, idx: int) -> None:
        if idx % self.every == 0 and self.path.is_file():
            try:
                n = int(self.path.read_text().strip())
            except ValueError:
                return
            if n >= 1 and n != torch.get_num_threads():
                torch.set_num_threads(n)
                print(f"distill: now {n} threads", file=sys.stderr, flush=True)


def fit(argv: list[str] | None = None) -> None:
    run, trainer, module, data, cb, last = lightning_cli(DistillModule, CorpusDataModule, RunConfig, argv)
    if run.threads_file:
        trainer.callbacks.append(ThreadsFromFile(run.threads_file))
    trainer.fit(module, datamodule=data, ckpt_path=str(last) if run.resume and last.exists() else None)
    if not run.export or trainer.global_rank != 0:
        return
    best = cb.best_model_path or str(last)
    best_module = load_module(best)
    meta = build_metadata(best_module, best, data.corpus, ckpt_metrics(best), data.train_tokens(),
                          data.extra_corpora)
    out = export_draft(best_module, Path(run.drafts) / run.name, meta, run.dtype)
    print(f"distill: exported {best} -> {out}", file=sys.stderr)


def _peek_kind(argv: list[str]) -> str | None:
    """run.kind of the --config file (eagle3 = the feature head's trainer)."""
    import yaml

    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv) and Path(argv[i + 1]).is_file():
            return ((yaml.safe_load(Path(argv[i + 1]).read_text()) or {}).get("run") or {}).get("kind")
    return None


def export_main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m training.distill export")
    add_option(p, "ckpt", required=True)
    add_option(p, "name", required=True)
    # not --drafts alone: gpu_pack's --drafts picks the drafts it carries ("--drafts DIR" still reads as this)
    p.add_argument("--drafts-dir", dest="drafts", default="checkpoints/drafts", help="where drafts are written: <drafts-dir>/<name>/")
    add_option(p, "corpus", default="data/corpus")
    add_option(p, "dtype", default="bfloat16", only=("bfloat16", "float16"))
    a = p.parse_args(argv)
    if not Path(a.ckpt).is_file():
        raise SystemExit(f"error: checkpoint not found: {a.ckpt}")
    module = load_module(a.ckpt)
    meta = build_metadata(module, a.ckpt, a.corpus, ckpt_metrics(a.ckpt), None)
    print(export_draft(module, Path(a.drafts) / a.name, meta, a.dtype))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["export"]:
        export_main(args[1:])
    elif _peek_kind(args) == "eagle3":  # the feature head: training/head/train.py
        from training.head.train import fit as fit_feature

        fit_feature(argv)
    else:
        fit(argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
