"""The serve contract as a promotion gate (training.head.redistill): a challenger that vLLM
would serve differently from specstop (other tokens, other accepted counts, or not loading at
all) is not promoted. Without vLLM the gate is skipped, and the skip is recorded."""

from __future__ import annotations

from pathlib import Path


def serve_gate(head: Path, target: str | None, python: str | None, rows: list[dict],
               max_new_tokens: int, log=print) -> dict:
    """{"status": "passed" | "failed" | "skipped", "reason", "failures"} for `head`.
    rows: [{"id", "kind", "ids"}] held-out prompts (token ids of `target`)."""
    from decoding.models import ModelError

    from training.export.check import CheckConfig, CheckError, check

    if not python:
        return {"status": "skipped", "reason": "serve check disabled (serve_check_python: null)"}
    if not Path(python).is_file():
        return {"status": "skipped", "reason": f"no vLLM python at {python} (make serve-check builds it)"}
    cfg = CheckConfig(python=python, draft=str(head), target=target, max_new_tokens=max_new_tokens,
                      contract_only=True)
    try:
        result = check(cfg, None, log, rows=rows)
    except (CheckError, ModelError) as e:  # vLLM is there but cannot serve this head
        return {"status": "failed", "reason": str(e).splitlines()[0], "failures": [str(e).splitlines()[0]]}
    c = result["contract"]
    return {"status": "passed" if c["ok"] else "failed", "vllm": result["vllm"],
            "reason": "vLLM serves it as specstop does" if c["ok"] else c["failures"][0],
            "failures": c["failures"], "prompts": len(rows),
            "accepted": [p["vllm_accepted"] for p in result["accepted_per_prompt"]]}


def gate_promotion(cfg, challenger: Path, rows: list[dict], promote: bool, reason: str, log=print):
    """(promote, reason, record) after the serve gate of a redistill config `cfg`: run only on
    a challenger the quality gate would promote; a failed contract keeps the champion."""
    if not promote:
        return promote, reason, {"status": "not run", "reason": "champion kept"}
    held = [{"id": f"heldout-{i}", "kind": "heldout", "ids": list(r["prompt_ids"])}
            for i, r in enumerate(rows[:cfg.serve_check_prompts])]
    record = serve_gate(challenger, cfg.target, cfg.serve_check_python, held, cfg.serve_check_tokens, log)
    log(f"serve check: {record['status']} ({record['reason']})")
    if record["status"] == "failed":
        return False, f"serve contract broken: {record['reason']}", record
    return promote, reason, record
