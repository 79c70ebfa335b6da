"""What a long prompt arriving does to the streams already running, with and without chunked
prefill (`python -m decoding.bench.prefill_stall`): in one process, the shipped pair on the server's
batched engine (joint budget), `--streams` chat requests decode; at `--arrive` rounds a prompt of
`--long` tokens joins. A running stream's inter-token latency is the time between rounds that gave
it tokens (a speculative round gives several: the per-token view divides each gap by the tokens it
delivered); the table gives its p50 and p99 before the arrival and from it on, the p99 after over
the p50 before (the stall a stream sees), the worst gap, how many gaps exceed twice the p50 before,
and the long prompt's own time to first token (the run goes on until it comes, and says how many
streams were still running then), for each chunk (0: the whole prompt in one round;
N tokens; auto: sized each round by time, decoding.batch.prefill), the modes in turn
(OUT/results.json, results.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_once(decoder, chunk: str, prompts: list[list[int]], long: list[int], arrive: int, new_tokens: int,
             stall_factor: float = 2.0) -> dict:
    from decoding.batch.prefill import parse_chunk
    from decoding.serve.worker import batch_engine

    engine = batch_engine(decoder, "joint", parse_chunk(chunk, stall_factor))  # a fresh sizer each run
    reqs = [engine.add(p, new_tokens) for p in prompts]
    last = {id(r): None for r in reqs}
    before, after, stall = [], [], 0.0
    per_tok = {False: [], True: []}  # each gap over the tokens it delivered, before / after
    big = ttft = None
    fill_rounds = streams_left = float("nan")
    # until the streams end and the long prompt has its first token (a small chunk may take longer)
    while any(r in engine.active for r in reqs) or (big is not None and ttft is None and big in engine.active):
        if engine.rounds == arrive and big is None:
            big, t_in = engine.add(long, 8), time.perf_counter()
        t0 = time.perf_counter()
        engine.step()
        t = time.perf_counter()
        stall = max(stall, t - t0) if big is not None else stall
        if big is not None and big.out and ttft is None:
            ttft, fill_rounds = t - t_in, engine.rounds - arrive
            streams_left = sum(r in engine.active for r in reqs)
        for r in reqs:
            n = len(r.out)
            if n and last[id(r)] != n:
                if last[id(r)] is not None:
                    gap = 1000 * (t - r._t)
                    (after if big is not None else before).append(gap)
                    per_tok[big is not None].append(gap / (n - last[id(r)]))
                r._t, last[id(r)] = t, n
    p50, tok50 = _pct(before, .5), _pct(per_tok[False], .5)
    return {"chunk": chunk, "before_p50": p50, "before_p99": _pct(before, .99),
            "after_p50": _pct(after, .5), "after_p99": _pct(after, .99), "after_max": max(after, default=0.0),
            "after_p99_over_before_p50": _pct(after, .99) / p50,
            "after_p99_over_before_p99": _pct(after, .99) / _pct(before, .99),
            "after_max_over_before_p50": max(after, default=0.0) / p50,
            "tok_before_p50": tok50, "tok_before_p99": _pct(per_tok[False], .99),
            "tok_after_p50": _pct(per_tok[True], .5), "tok_after_p99": _pct(per_tok[True], .99),
            "tok_after_p99_over_before_p50": _pct(per_tok[True], .99) / tok50,
            "slow_after": sum(x > 2 * p50 for x in after), "worst_round_ms": 1000 * stall,
            "long_ttft_ms": 1000 * (ttft or float("nan")), "long_rounds": fill_rounds,
            "streams_at_long_ttft": streams_left}


def main(argv=None) -> int:
    import argparse

    import torch

    from decoding.api import Decoder
    from decoding.batch.prefill import parse_chunk
    from decoding.bench.config import load_prompts
    from decoding.options import add_option

    ap = argparse.ArgumentParser(prog="python -m decoding.bench.prefill_stall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "out", required=True)
    add_option(ap, "threads", default=2)
    ap.add_argument("--chunks", default="0,128,auto",
                    help="chunks to compare: N tokens a round, 0 (whole prompts) or auto (sized by time)")
    ap.add_argument("--stall", type=float, default=2.0,
                    help="auto's aim: a round carrying prompt rows at most this many times one without")
    ap.add_argument("--streams", type=int, default=3, help="requests decoding when the long prompt comes")
    ap.add_argument("--long", type=int, default=2000, help="tokens of the arriving prompt")
    ap.add_argument("--arrive", type=int, default=20, help="the round at which it arrives")
    add_option(ap, "new_tokens", default=160)
    add_option(ap, "repeats", default=2)
    add_option(ap, "kv_dtype")
    a = ap.parse_args(argv)
    chunks = [c.strip().lower() for c in a.chunks.split(",")]
    try:
        for c in chunks:
            parse_chunk(c, a.stall, "--chunks")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    dec = Decoder.load(kv_dtype=a.kv_dtype)
    s = dec.session
    rows = load_prompts("data/prompts/heldout_general.jsonl", 40)
    prompts = [s.encode(r["prompt"], chat=True) for r in rows[:a.streams]]
    long = []
    for r in rows[a.streams:]:
        long += s.encode(r["prompt"])
    while len(long) < a.long:
        long += long
    long = long[:a.long]
    run_once(dec, "0", prompts, long[:200], 2, 8)  # warm: kernels, allocator
    got = {c: [] for c in chunks}
    for _ in range(a.repeats):
        for c in chunks:  # the modes in turn
            got[c].append(run_once(dec, c, prompts, long, a.arrive, a.new_tokens, a.stall))
            print(json.dumps(got[c][-1]), flush=True)
    summary = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "chunk"} for c, rs in got.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": got, "median": summary, "args": vars(a)}, indent=1))
    from decoding.forward import cpu

    cpu_line = cpu.describe()
    lines = [f"# A {a.long}-token prompt arriving beside {a.streams} streams (`python -m decoding.bench.prefill_stall`)",
             "", f"{cpu_line}, {a.threads} threads, the target's KV cache in {a.kv_dtype or 'float32'}.",
             "", "Inter-token latency of the running streams, ms (median of the repeats); per token: each gap "
             "over the tokens it delivered; auto aims at a round with prompt rows at most "
             f"{a.stall:g}x one without:", "",
             "| chunk | p50 before | p99 before | p50 after | p99 after | p99 after / p50 before | worst after "
             "| per token: p50 before | p99 after | p99 after / p50 before | gaps > 2x p50 after "
             "| long prompt's first token (rounds) | streams running then |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, m in summary.items():
        lines.append(f"| {'whole prompt' if c == '0' else c} | {m['before_p50']:.1f} | {m['before_p99']:.1f} | "
                     f"{m['after_p50']:.1f} | {m['after_p99']:.1f} | {m['after_p99_over_before_p50']:.1f}x | "
                     f"{m['after_max']:.0f} | {m['tok_before_p50']:.1f} | {m['tok_after_p99']:.1f} | "
                     f"{m['tok_after_p99_over_before_p50']:.1f}x | {m['slow_after']:.0f} | "
                     f"{m['long_ttft_ms']:.0f} ({m['long_rounds']:.0f}) | {m['streams_at_long_ttft']:.0f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
