"""`make serve-check`: the exported head in vLLM beside the embedded target, checked against
specstop's own engine (a contract, not a format on paper).

    python -m training.export.check [--python .venv-vllm/bin/python] [--out runs/serve-check]
        [--per-domain 6] [--max-new-tokens 96] [--contract-only]

On the project's held-out prompts (the first `per_domain` of heldout_general / heldout_code,
chat template applied by specstop, the same token ids to both engines), greedy, one thread:
- contract (fp32): vLLM + head == plain vLLM == specstop `ar` == specstop `sd --gamma 3
  --stop fixed` token for token, and the draft tokens vLLM accepts per prompt == those of
  specstop's `sd --gamma 3 --stop fixed --head-window 0` (vLLM's head reads the whole context);
  specstop runs a GGUF target's dequantized fp32 linears here (decoding.forward.quant.dequantized),
  the numbers vLLM serves, not its blocks with int8 activations (those flip greedy near-ties);
- report: tokens/s of vLLM plain, vLLM + head, specstop `ar` and specstop's default, fp32 and
  bf16, one run each (bf16 equality to plain vLLM is reported, not required).
vLLM runs in its own venv (training/export/vllm_side.py, one engine per process, JSON lines), kept
alive while the prompts alternate between it and specstop's engine (training/export/paired.py).
Exit codes: 0 contract holds | 1 contract broken | 2 bad input or vLLM unusable.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from decoding.options import add_option

from training.export.paired import CheckError, run_paired  # noqa: F401 (CheckError re-exported)
from training.export.report import SD_ROW, summarise, trim, write_report  # noqa: F401 (trim re-exported)

VLLM_PYTHON = ".venv-vllm/bin/python"
DOMAINS = {"general": "data/prompts/heldout_general.jsonl", "code": "data/prompts/heldout_code.jsonl"}


@dataclass
class CheckConfig:
    python: str = VLLM_PYTHON
    draft: str | None = None
    target: str | None = None
    per_domain: int = 6
    max_new_tokens: int = 96
    gamma: int = 3
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    speculators: bool = True
    """Also serve a `--format speculators` export as `vllm serve DIR` would (fp32, in the contract)."""
    contract_only: bool = False
    """Only the fp32 contract (no bf16, no specstop default): the re-distillation gate."""
    timeout_s: int = 3600


def prompts(per_domain: int) -> list[dict]:
    out = []
    for kind, path in DOMAINS.items():
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        out += [{"id": r["id"], "kind": kind, "prompt": r["prompt"]} for r in rows[:per_domain]]
    return out


def contract(rows, mine: dict, theirs: dict, eos: set[int]) -> list[str]:
    """Contract failures, one line each (empty: it holds)."""
    fails = []
    ref = [trim(o, eos) for o in theirs["float32/plain"]["outputs"]]
    heads = {"vLLM + head": theirs["float32/head"]}
    if "float32/speculators" in theirs:
        heads["vLLM speculators export"] = theirs["float32/speculators"]
    outs = {**{k: v["outputs"] for k, v in heads.items()}, "specstop ar": mine["float32/ar"]["outputs"],
            "specstop sd": mine["float32/sd"]["outputs"]}
    for name, got in outs.items():
        for r, a, b in zip(rows, ref, got):
            if trim(b, eos) != a:
                fails.append(f"fp32 {name} differs from plain vLLM on {r['id']}")
    for name, run in heads.items():
        for r, a, b in zip(rows, run["accepted"], mine["float32/sd"]["accepted"]):
            if a != b:
                fails.append(f"{r['id']}: {name} accepted {a} draft tokens, {SD_ROW} {b}")
    return fails


def check(cfg: CheckConfig, out_dir: Path | None, log=print, rows: list[dict] | None = None) -> dict:
    """Export, run both halves, compare; returns the results (written to out_dir when given).
    rows: [{"id", "kind", "ids"}] prompts already tokenised (default: the held-out files)."""
    import torch

    from decoding import models
    from decoding.defaults import DEFAULT_DRAFT

    from training.export.formats import to_eagle3, trained_window

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg.draft = str(models.resolve_model_dir(cfg.draft or DEFAULT_DRAFT))
    target_dir = str(models.resolve_model_dir(cfg.target) if cfg.target else models.default_target_dir())
    if cfg.contract_only:
        cfg.dtypes = ["float32"]
    from decoding import Decoder

    base = Decoder.load(cfg.target, cfg.draft, dtype="float32", strategy="ar")
    chat = bool(getattr(base.tokenizer, "chat_template", None))
    rows = rows or [r | {"ids": base.prompt_ids(r["prompt"], chat=chat, max_new_tokens=cfg.max_new_tokens)}
                    for r in prompts(cfg.per_domain)]
    eos = {int(base.session.eos_token_id)} if base.session.eos_token_id is not None else set()
    from decoding.drafts.io import load_feature_draft

    with tempfile.TemporaryDirectory(prefix="serve-head-") as tmp:
        head = load_feature_draft(cfg.draft, base.session.target)
        tcfg, window = base.session.target.config, trained_window(Path(cfg.draft))
        export = to_eagle3(head, Path(tmp) / "head", "float32", tcfg, window=window)
        spec = to_eagle3(head, Path(tmp) / "speculators", "float32", tcfg, window=window, fmt="speculators",
                         verifier=target_dir, speculative_tokens=cfg.gamma) if cfg.speculators else None
        del base
        log(f"serve-check: export + prompts {time.perf_counter() - t0:.0f} s")
        request = {"target": target_dir, "draft": str(export), "max_tokens": cfg.max_new_tokens,
                   "eos": sorted(eos), "speculative_tokens": cfg.gamma,
                   "max_model_len": min(1024, tcfg.max_position_embeddings)}
        theirs, mine = run_paired(cfg, rows, request, spec and str(spec), log)
    fails = contract(rows, mine, theirs["runs"], eos)
    result = summarise(cfg, rows, mine, theirs, eos, fails, time.perf_counter() - t0)
    if out_dir is not None:
        write_report(out_dir, result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.export.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=VLLM_PYTHON, help="python of the venv vLLM is installed in")
    add_option(ap, "draft")
    add_option(ap, "target")
    add_option(ap, "out", default="runs/serve-check")
    ap.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain")
    add_option(ap, "max_new_tokens", default=96)
    ap.add_argument("--contract-only", action="store_true", help="fp32 contract only (no speed rows)")
    a = ap.parse_args(argv)
    cfg = CheckConfig(python=a.python, draft=a.draft, target=a.target, per_domain=a.per_domain,
                      max_new_tokens=a.max_new_tokens, contract_only=a.contract_only)
    from decoding.models import ModelError

    try:
        result = check(cfg, Path(a.out))
    except (CheckError, ModelError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in result["contract"]["failures"]:
        print(f"contract: {line}", file=sys.stderr)
    print(f"serve-check: contract {'holds' if result['contract']['ok'] else 'BROKEN'}; report in {a.out}")
    return 0 if result["contract"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
