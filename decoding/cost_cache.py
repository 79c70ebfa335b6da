"""This machine's cost curve for a pair, timed once and kept: a grown tree (`grow_cost:
measure`) loaded through `decoding.Decoder` / `python -m decoding.generate` pays the 10-30 s of
timing on its first load only.

The key is everything the curve depends on: both models' fingerprints, dtype, device, torch
threads, the CPU model, the torch version, and the sizes and unit it is timed in. Another
machine, dtype or thread count is a miss, never a stale hit. A hit is also spot-checked: two
sizes are timed again (1-3 s) and a curve off by more than `TOLERANCE` (one timed while the
machine was busy, or on a machine that has since changed) is re-timed. Files live under
`$SPECSTOP_CACHE/cost/` (git-ignored, like the converted target) and are written atomically.
Benchmarks time the curve afresh at the start of every run instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from .fast_forward import forward_kind
from .fingerprint import fingerprint
from . import growth
from .growth import COST_SIZES, TOKENS, CostCurve, measure_cost
from .models import cache_root

TOLERANCE = 1.5
"""A stored curve is kept while the spot-checked sizes time within this factor of it, either way
(a curve timed under load read 100 ms flat where an idle 2-core machine takes 33-67 ms)."""
SPOT_SIZES = (1, 8)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(target, draft) -> dict:
    """What the curve depends on (readable, stored beside the curve)."""
    dev = next(target.parameters()).device
    return {
        "target": fingerprint(target)["weights_sha256"], "draft": fingerprint(draft)["weights_sha256"],
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "forward": forward_kind(target),
        "sizes": list(COST_SIZES), "unit": TOKENS,  # how it is timed: a curve of another kind is a miss
    }


def spot_check(target, curve: CostCurve, tolerance: float = TOLERANCE) -> str | None:
    """None if the target's forwards still time like the stored curve at SPOT_SIZES, else what
    differs (~1-3 s on a CPU: each timing reads a 256-token context first)."""
    for n, ms in zip(SPOT_SIZES, growth.time_forwards(target, SPOT_SIZES, repeats=2)):
        was = curve.target(n)
        if not was / tolerance <= ms <= was * tolerance:
            return f"{n} new tokens take {ms:.1f} ms now, {was:.1f} ms stored"
    return None


def cached_cost(target, draft, root: Path | None = None, tolerance: float | None = TOLERANCE) -> tuple[CostCurve, str]:
    """(curve, how it was obtained): the stored curve for this key if a spot check still agrees
    with it (`tolerance` None: no check), else timed now and stored."""
    key = cost_key(target, draft)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = (root or cache_root() / "cost") / f"{digest}.json"
    why = "once; stored in " + str(path.parent)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            curve = CostCurve.from_dict(stored["curve"])
            off = spot_check(target, curve, tolerance) if tolerance else None
            if off is None:
                return curve, f"timed on this machine earlier ({path})"
            why = f"the stored one is off: {off}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: time it again and overwrite
    print(f"timing this machine's forwards for the grown tree's cost curve ({why})",
          file=sys.stderr, flush=True)
    curve = measure_cost(target, draft)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "curve": {"sizes": curve.sizes, "target_ms": curve.target_ms,
                                             "draft_ms": curve.draft_ms, "unit": curve.unit}}, f, indent=1)
        os.replace(tmp, path)
    except OSError:  # an unwritable cache costs a re-timing at the next load, nothing else
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        return curve, "timed on this machine now (the cache is not writable)"
    return curve, "timed on this machine now (stored for the next load)"
