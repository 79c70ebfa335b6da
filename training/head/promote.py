"""Promote a trained feature head over the shipped one, behind the paired-evaluation gate.

    python -m training.head.promote --challenger checkpoints/training/smollm2-135m-eagle3-wsd/best \\
        --evidence reports/head-train-2026-12-07/eval_greedy_wsd.json

The maintainer's step for a head trained outside training.head.redistill (a chunked run, a GPU
session): redistill's gate promotes only the challengers it trains itself.

1. Resolve: both heads load against the target (refused: not a head, another target's head).
2. Gate: the evidence is `python -m training.bench.head --greedy --baseline B` run on this head,
   B the champion's own evaluation on the same prompts (each known by its weights'
   fingerprint, else by its path); the paired 95% interval of step-1 agreement must clear 0 on
   every prompt kind. vLLM's and llama.cpp's checks of the export
   (`make serve-check`, `make llama-check`) need their own installs: run them before this.
3. Lineage: the promoted copy's marker records `redistilled_from` (the champion's fingerprint),
   as redistill's promotions do, so training.retrain knows the deciders fitted for the old head
   can no longer judge the pair and lets a challenger replace them.
4. Swap: a complete copy beside the champion, exchanged for it in one rename
   (training.swap.replace_dir): a running server reloads it (decoding/serve/reload.py).

Exit codes: 0 promoted | 10 kept (the gate says no) | 11 up to date (the champion already holds
this head) | 2 bad input (one `error:` line). The champion is untouched by every non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from decoding.options import add_option

from training.head.redistill import EXIT_BAD_INPUT, EXIT_KEPT, EXIT_PROMOTED, EXIT_UP_TO_DATE, mark_lineage

SHIPPED = Path("checkpoints/drafts/smollm2-135m-eagle3")


def describes(record: dict, path: Path, weights: str | None) -> bool:
    """Whether an evaluation's record is of this head: by its weights where both are known (a
    path's head changes when a promotion replaces it), else by its path."""
    if record.get("weights_sha256") and weights:
        return record["weights_sha256"] == weights
    return Path(record.get("head", "")).resolve() == Path(path).resolve()


def gate(evidence: dict, head: Path, champion: Path, head_weights: str | None = None,
         champion_weights: str | None = None) -> tuple[bool, str]:
    """Whether a greedy paired evaluation shows `head` better than `champion` at step 1 on
    every kind; raises ValueError where the file is not that evaluation."""
    if not describes(evidence, head, head_weights):
        raise ValueError(f"the evidence evaluates {evidence.get('head')}, not {head}")
    if evidence.get("continuations") != "greedy":
        raise ValueError("the evidence is not a greedy evaluation (python -m training.bench.head --greedy)")
    kinds = evidence.get("teacher_forced") or {}
    if not kinds:
        raise ValueError("the evidence holds no teacher-forced results")
    verdicts, bases = [], {}
    for kind, r in kinds.items():
        paired = r.get("vs_baseline")
        if not paired:
            raise ValueError(f"the evidence's {kind} results are not paired (run it with --baseline)")
        f = Path(paired["baseline"])
        if f not in bases:  # every kind names the same file
            bases[f] = json.loads(f.read_text()) if f.is_file() else {}
        if not describes(bases[f], champion, champion_weights):
            raise ValueError(f"the evidence's baseline {paired['baseline']} does not evaluate the head in {champion}")
        diff, low, high = paired["agree_step1"]
        verdicts.append((low > 0, f"{kind} step 1 {diff:+.3f} [{low:+.3f}, {high:+.3f}]"))
    return all(ok for ok, _ in verdicts), "; ".join(text for _, text in verdicts)


def promote(head: Path, champion: Path, evidence: Path, target=None, log=print) -> int:
    from decoding.drafts.io import load_feature_draft
    from decoding.models import ModelError, fingerprint, load_model, same_model

    try:
        if not head.is_dir() or not champion.is_dir():
            raise ValueError(f"no head directory at {head if not head.is_dir() else champion}")
        t = load_model(target, "float32")
        old, new = fingerprint(load_feature_draft(champion, t)), fingerprint(load_feature_draft(head, t))
        if same_model(old, new):  # the weights, whatever the markers say
            log(f"up to date: {champion} already holds {head}'s weights")
            return EXIT_UP_TO_DATE
        ok, why = gate(json.loads(evidence.read_text()), head, champion, new["weights_sha256"], old["weights_sha256"])
    except (ValueError, ModelError, OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        log(f"error: {e}")
        return EXIT_BAD_INPUT
    if not ok:
        log(f"kept {champion}: the paired interval does not clear 0 ({why})")
        return EXIT_KEPT
    tmp = champion.with_name(f".{champion.name}.promote-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(head, tmp)
    mark_lineage(tmp, old, f"promoted from {head}")
    from training.swap import replace_dir

    replace_dir(tmp, champion)
    log(json.dumps({"promoted": str(head), "champion": str(champion), "gate": why}))
    return EXIT_PROMOTED


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.head.promote", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--challenger", required=True, metavar="DIR", help="the head directory to promote")
    p.add_argument("--evidence", required=True,
                   help="python -m training.bench.head --greedy --baseline ... output for this head")
    p.add_argument("--champion", default=str(SHIPPED), help="the head directory it replaces")
    add_option(p, "target")
    a = p.parse_args(argv)
    return promote(Path(a.challenger), Path(a.champion), Path(a.evidence), a.target,
                   log=lambda m: print(m, file=sys.stderr if m.startswith(("error", "kept")) else sys.stdout))


if __name__ == "__main__":
    sys.exit(main())
