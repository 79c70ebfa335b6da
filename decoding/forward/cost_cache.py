"""This machine's cost curve for a pair, timed once and kept: a grown tree (`grow_cost:
measure`) loaded through `decoding.Decoder` / `python -m decoding.generate` pays the timing
(seconds) on its first load only.

The key is everything the curve depends on: both models' fingerprints, dtype, device, torch
threads, the CPU model, the torch version, and the sizes and unit it is timed in. Another
machine, dtype, thread count or forward is a miss, never a stale hit. A hit is
trusted as stored: it is not re-timed because the machine is busy for a moment (a spot check
that did so cost more on busy moments than it saved); set $SPECSTOP_RETIME_COST=1 to re-time it.
Files live under `$SPECSTOP_CACHE/cost/` (git-ignored, like the converted target) and are
written atomically. Benchmarks time the curve afresh at the start of every run instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from decoding.forward import cpu, kernels, quant
from decoding.forward.packed import REVISION, forward_kind
from decoding.models.fingerprint import fingerprint
from decoding.forward.cost import CONTEXTS, COST_SIZES, KEY_SIZES, TOKENS, CostCurve, measure_cost
from decoding.models.named_targets import cache_root
from decoding.kv_cache import kv_dtype

HOST_WORK = 2
"""Revision of what a curve prices beyond the forwards (1: a level's and a tree round's host work,
decoding.growth.time_host_work; 2: a feature head's levels drawn over its own vocabulary): a curve
stored under another is a miss and is timed again."""

RETIME_ENV = "SPECSTOP_RETIME_COST"
"""Set to 1 to re-time (and overwrite) the stored curve on the next load."""


def _forward_tag(target) -> str:
    """The forward kind, its revision, and whether decoding.forward.kernels run it (a curve timed
    with the kernels is not this machine's curve with SPECSTOP_CPU_KERNELS=0, nor with torch's
    attention, SPECSTOP_BATCH_INVARIANT=0)."""
    kind = forward_kind(target)
    if kind == "eager":
        return kind
    on = getattr(target, "_specstop_kernels", True) and kernels.available()
    tag = f"{kind}-r{REVISION}" + ("-kernels" if on else "") + ("-sdpa" if on and not kernels.batch_invariant() else "")
    return tag + (f"-gguf-{quant.isa()}-{quant.revision()}" if quant.quantized(target) else "")


def _draft_step(draft) -> str:
    """How a feature head steps here (its lean step on the AVX512 kernels or on the quantized
    library's AVX2 ops, or its modules): a head's curve timed one way is not another's."""
    from decoding.drafts import lean_step

    if not hasattr(draft, "midlayer") or not lean_step.shares_steps(draft):
        return "modules"
    return "lean-kernels" if kernels.batch_invariant() else "lean-quant"


def cost_key(target, draft, host_work=None) -> dict:
    """What the curve depends on (readable, stored beside the curve)."""
    dev = next(target.parameters()).device
    return {
        "host_timed": host_work is not None,
        "target": fingerprint(target)["weights_sha256"], "draft": fingerprint(draft)["weights_sha256"],
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu.model_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "forward": _forward_tag(target),
        "draft_blocks": quant.quantized(draft),  # a head on blocks keeps its checkpoint's fingerprint
        "draft_step": _draft_step(draft),
        **({"kv_dtype": "float16"} if kv_dtype(target) is not None else {}),  # (absent: older curves still hit)
        "sizes": list(COST_SIZES), "unit": TOKENS,  # how it is timed: a curve of another kind is a miss
        "contexts": list(CONTEXTS), "key_sizes": list(KEY_SIZES),
        "host_work": HOST_WORK,
    }


def cached_cost(target, draft, root: Path | None = None, retime: bool | None = None,
                host_work=None) -> tuple[CostCurve, str]:
    """(curve, how it was obtained): the stored curve for this key, else timed now and stored;
    `retime` (None: $SPECSTOP_RETIME_COST) times it again whatever is stored; `host_work`: as
    measure_cost's (a curve timed without it is stored under another key)."""
    key = cost_key(target, draft, host_work)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = (root or cache_root() / "cost") / f"{digest}.json"
    why = "once; stored in " + str(path.parent)
    if retime is None:
        retime = os.environ.get(RETIME_ENV, "").strip() not in ("", "0")
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and not retime:
            return CostCurve.from_dict(stored["curve"]), f"timed on this machine earlier ({path})"
        why = f"${RETIME_ENV} is set" if retime else why
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: time it again and overwrite
    print(f"timing this machine's forwards for the grown tree's cost curve ({why})",
          file=sys.stderr, flush=True)
    curve = measure_cost(target, draft, host_work=host_work)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "curve": curve.to_dict()}, f, indent=1)
        os.replace(tmp, path)
    except OSError:  # an unwritable cache costs a re-timing at the next load, nothing else
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        return curve, "timed on this machine now (the cache is not writable)"
    return curve, "timed on this machine now (stored for the next load)"
