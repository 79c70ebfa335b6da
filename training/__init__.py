"""Training: decider traces and fitting, the drafts (stand-alone and feature head), corpora, export
and scheduled retraining. It needs the `[train]` extra (`pip install 'specstop[train]'`); an
inference-only install runs `decoding` and is told so here in one line."""

import importlib.util
import sys

TRAIN_EXTRA = ("lightning", "datasets", "peft", "sklearn", "jsonargparse")
"""Modules of the [train] extra (pyproject.toml): Lightning, datasets, PEFT, scikit-learn and
LightningCLI's argument parser."""


def _have(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # sys.modules[name] is None: blocked
        return False


_missing = [m for m in TRAIN_EXTRA if not _have(m)]
if _missing:
    _why = f"training needs the [train] extra: pip install 'specstop[train]' (missing: {', '.join(_missing)})"
    if sys.argv[:1] == ["-m"]:  # `python -m training.X` is being located: a command, so one line
        print(f"error: {_why}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(_why)
