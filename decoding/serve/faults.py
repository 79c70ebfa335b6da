"""An opt-in fault for load tests of a real server process: with $SPECSTOP_FAULT_SEED=N set, a
request sent with `"seed": N` raises inside the engine at every round it commits, as a fault of its
own would (the fault-isolation path of decoding.batch.scheduler: that request ends with an error,
the round's others run on). Unset, nothing is patched; `python -m decoding.serve` calls `install`
at start-up (`python -m decoding.bench --suite serve-load` sets the variable for its server)."""

from __future__ import annotations

import os

ENV = "SPECSTOP_FAULT_SEED"


class InjectedFault(RuntimeError):
    """What a marked request raises."""


def install(environ=os.environ) -> int | None:
    """Patch BatchEngine._commit to fail the requests seeded $SPECSTOP_FAULT_SEED; the seed, or None
    (nothing patched) when the variable is unset or empty."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    seed = int(raw)
    from decoding.batch.scheduler import BatchEngine

    commit = BatchEngine._commit
    if getattr(commit, "fault_seed", None) is not None:  # installed already
        return seed

    def faulty(self, r, *a, **k):
        if r.seed == seed:
            raise InjectedFault(f"injected fault (request seeded {seed}, ${ENV})")
        return commit(self, r, *a, **k)

    faulty.fault_seed = seed
    BatchEngine._commit = faulty
    return seed
