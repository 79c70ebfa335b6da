"""What a device round's steps cost: the draft alone, the draft and the verify, and the whole round,
each run `reps` times from the same state (captured alone and timed by CUDA events on CUDA; eager
on a CPU), so draft = t(draft), verify = t(draft + verify) - t(draft), accept + commit =
t(round) - t(draft + verify)."""

from __future__ import annotations

import time

import torch


def split_ms(engine, prompt_ids, reps: int = 30) -> dict:
    r = engine.runner
    with torch.inference_mode():
        r.prefill(list(prompt_ids))
        length = len(prompt_ids)
        r.ensure(length + r.span())
        cols = r.cols_for(length)

        def draft():
            return r.draft(cols)[0]

        def draft_verify():
            return r.verify(torch.cat((r.pending[None], r.draft(cols)[0])), cols)

        parts = {"draft": draft, "draft+verify": draft_verify, "round": lambda: r.round(cols)}
        state = [t.clone() for t in engine._state()]
        ms = {}
        pool, engine.pool = engine.pool, None  # these graphs are dropped after: a pool of their own
        try:
            for name, fn in parts.items():
                run = engine.capture_fn(fn).replay if engine.capture else fn
                ms[name] = _time(run, reps, engine.capture, lambda: engine.restore(state))
        finally:
            engine.pool = pool if engine.epoch == r.epoch else None
    return {"draft_ms": ms["draft"], "verify_ms": ms["draft+verify"] - ms["draft"],
            "accept_commit_ms": ms["round"] - ms["draft+verify"], "round_ms": ms["round"]}


def _time(run, reps: int, cuda: bool, reset) -> float:
    """Median ms of `run` over `reps` calls, the round's state put back before each."""
    out = []
    for _ in range(reps + 2):
        reset()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            run()
            out.append(1000 * (time.perf_counter() - t))
    out = sorted(out[2:])
    return out[len(out) // 2]
