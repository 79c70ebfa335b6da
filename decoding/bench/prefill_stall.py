"""What a long prompt arriving does to the streams already running, with and without chunked
prefill (`python -m decoding.bench.prefill_stall`): in one process, the shipped pair on the server's
batched engine (joint budget), `--streams` chat requests decode; at `--arrive` rounds a prompt of
`--long` tokens joins. A running stream's inter-token latency is the time between rounds that gave
it tokens; the table gives its p50 and p99 before the arrival and from it on, the worst gap, how
many gaps exceed twice the p50 before, and the long prompt's own time to first token, for each
chunk size (0: the whole prompt in one round), the modes in turn (OUT/results.json, results.md).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_once(decoder, chunk: int, prompts: list[list[int]], long: list[int], arrive: int, new_tokens: int) -> dict:
    from decoding.serve.worker import batch_engine

    engine = batch_engine(decoder, "joint", chunk)
    reqs = [engine.add(p, new_tokens) for p in prompts]
    last = {id(r): None for r in reqs}
    before, after, stall = [], [], 0.0
    big = None
    ttft = None
    while any(r in engine.active for r in reqs):
        if engine.rounds == arrive and big is None:
            big, t_in = engine.add(long, 8), time.perf_counter()
        t0 = time.perf_counter()
        engine.step()
        t = time.perf_counter()
        stall = max(stall, t - t0) if big is not None else stall
        if big is not None and big.out and ttft is None:
            ttft = t - t_in
        for r in reqs:
            n = len(r.out)
            if n and last[id(r)] != n:
                if last[id(r)] is not None:
                    (after if big is not None else before).append(1000 * (t - r._t))
                r._t, last[id(r)] = t, n
    p50 = _pct(before, .5)
    return {"chunk": chunk, "before_p50": p50, "before_p99": _pct(before, .99),
            "after_p50": _pct(after, .5), "after_p99": _pct(after, .99), "after_max": max(after, default=0.0),
            "after_max_over_before_p50": max(after, default=0.0) / p50,
            "slow_after": sum(x > 2 * p50 for x in after), "worst_round_ms": 1000 * stall,
            "long_ttft_ms": 1000 * (ttft or float("nan"))}


def main(argv=None) -> int:
    import argparse

    import torch

    from decoding.api import Decoder
    from decoding.bench.config import load_prompts
    from decoding.options import add_option

    ap = argparse.ArgumentParser(prog="python -m decoding.bench.prefill_stall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "out", required=True)
    add_option(ap, "threads", default=2)
    ap.add_argument("--chunks", default="0,32,64,128,256", help="chunk sizes to compare (0: none)")
    ap.add_argument("--streams", type=int, default=3, help="requests decoding when the long prompt comes")
    ap.add_argument("--long", type=int, default=2000, help="tokens of the arriving prompt")
    ap.add_argument("--arrive", type=int, default=20, help="the round at which it arrives")
    add_option(ap, "new_tokens", default=160)
    add_option(ap, "repeats", default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dec = Decoder.load()
    s = dec.session
    rows = load_prompts("data/prompts/heldout_general.jsonl", 40)
    prompts = [s.encode(r["prompt"], chat=True) for r in rows[:a.streams]]
    long = []
    for r in rows[a.streams:]:
        long += s.encode(r["prompt"])
    while len(long) < a.long:
        long += long
    long = long[:a.long]
    chunks = [int(c) for c in a.chunks.split(",")]
    run_once(dec, 0, prompts, long[:200], 2, 8)  # warm: kernels, allocator
    got = {c: [] for c in chunks}
    for _ in range(a.repeats):
        for c in chunks:  # the modes in turn
            got[c].append(run_once(dec, c, prompts, long, a.arrive, a.new_tokens))
            print(json.dumps(got[c][-1]), flush=True)
    summary = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "chunk"} for c, rs in got.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": got, "median": summary, "args": vars(a)}, indent=1))
    lines = [f"# A {a.long}-token prompt arriving beside {a.streams} streams (`python -m decoding.bench.prefill_stall`)",
             "", "Inter-token latency of the running streams, ms (median of the repeats):", "",
             "| chunk | p50 before | p99 before | p50 after | p99 after | worst after | worst / p50 before "
             "| gaps > 2x p50 after | long prompt's first token |", "|---|---|---|---|---|---|---|---|---|"]
    for c, m in summary.items():
        lines.append(f"| {c or 'whole prompt'} | {m['before_p50']:.1f} | {m['before_p99']:.1f} | {m['after_p50']:.1f} | "
                     f"{m['after_p99']:.1f} | {m['after_max']:.0f} | {m['after_max_over_before_p50']:.0f}x | "
                     f"{m['slow_after']:.0f} | {m['long_ttft_ms']:.0f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
