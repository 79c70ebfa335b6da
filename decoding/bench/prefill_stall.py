"""What a long prompt arriving does to the streams already running, with and without chunked
prefill (`python -m decoding.bench.prefill_stall`): in one process, the shipped pair on the server's
batched engine (joint budget), `--streams` chat requests decode; at `--arrive` rounds a prompt of
`--long` tokens joins. A running stream's inter-token latency is the time between rounds that gave
it tokens (a speculative round gives several: the per-token view divides each gap by the tokens it
delivered); the table gives its p50 before the arrival and p50 and p99 from it on, the p99 after
over the p50 of the same rounds in a run where no long prompt comes (the stall a stream sees) and
over the p50 before, the worst gap, and the long prompt's own time to first token (the run goes on
until it comes, and says how many streams were still running then), for each chunk (0: the whole
prompt in one round; N tokens; auto: sized each round by time, decoding.batch.prefill), the modes
in turn, and the machine's own jitter on one fixed round (OUT/results.json, results.md).
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
             stall_factor: float = 1.5, whole: int = 256) -> dict:
    from decoding.batch.prefill import parse_chunk
    from decoding.serve.worker import batch_engine

    engine = batch_engine(decoder, "joint", parse_chunk(chunk, stall_factor, whole=whole))  # a fresh sizer each run
    reqs = [engine.add(p, new_tokens) for p in prompts]
    last = {id(r): None for r in reqs}
    before, after, stall = [], [], 0.0
    per_tok = {False: [], True: []}  # each gap over the tokens it delivered, before / after
    big = ttft = None
    fill_rounds = streams_left = float("nan")
    # until the streams end and the long prompt has its first token (a small chunk may take longer)
    while any(r in engine.active for r in reqs) or (big is not None and ttft is None and big in engine.active):
        arrived = engine.rounds >= arrive  # the same rounds count as "after" without a long prompt
        if arrived and big is None and long:
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
                    (after if arrived else before).append(gap)
                    per_tok[arrived].append(gap / (n - last[id(r)]))
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


def noise_floor(decoder, prompts: list[list[int]], times: int = 400) -> dict:
    """The same round over and over: one token fed after each of `prompts` in one batched forward of
    the target (as a plain round of the streams), then cut back. Its p99 over its p50 is what this
    machine's own jitter adds to any round (other tenants, the second thread's wake-ups): the floor
    under every p99 above."""
    from decoding.batch.forward import Segment, verify_many
    from decoding.kv_cache import CachedModel, crop
    from decoding.tree import TreeLayout

    target = decoder.session.target
    caches = [CachedModel(target) for _ in prompts]
    verify_many(target, [Segment(c, p, TreeLayout(()), []) for c, p in zip(caches, prompts)])
    ms = []
    for _ in range(times):
        t0 = time.perf_counter()
        verify_many(target, [Segment(c, p + [p[-1]], TreeLayout(()), []) for c, p in zip(caches, prompts)])
        ms.append(1000 * (time.perf_counter() - t0))
        for c, p in zip(caches, prompts):
            crop(c.cache, len(p))
            c.length = len(p)
    return {"p50": _pct(ms, .5), "p99": _pct(ms, .99), "p99_over_p50": _pct(ms, .99) / _pct(ms, .5)}


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
    ap.add_argument("--stall", type=float, default=1.5,
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
    modes = ["none", *chunks]  # none: the same streams, no long prompt (the p50 "without it")
    got = {c: [] for c in modes}
    for _ in range(a.repeats):
        for c in modes:  # the modes in turn
            got[c].append(run_once(dec, "0" if c == "none" else c, prompts, [] if c == "none" else long,
                                   a.arrive, a.new_tokens, a.stall))
            got[c][-1]["chunk"] = c
            print(json.dumps(got[c][-1]), flush=True)
    summary = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "chunk"} for c, rs in got.items()}
    without, tok_without = summary["none"]["after_p50"], summary["none"]["tok_after_p50"]
    for m in summary.values():
        m["after_p99_over_without_p50"] = m["after_p99"] / without
        m["tok_after_p99_over_without_p50"] = m["tok_after_p99"] / tok_without
    floor = noise_floor(dec, prompts)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": got, "median": summary, "floor": floor, "args": vars(a)},
                                                 indent=1))
    from decoding.forward import cpu

    lines = [f"# A {a.long}-token prompt arriving beside {a.streams} streams (`python -m decoding.bench.prefill_stall`)",
             "", f"{cpu.describe()}, {a.threads} threads, the target's KV cache in {a.kv_dtype or 'float32'}, "
             f"{a.new_tokens} new tokens a stream, the prompt arriving at round {a.arrive}.",
             "", "Inter-token latency of the running streams, ms (median of the repeats); after: from the arrival "
             "round on; without it: the same rounds of the same streams with no long prompt (the first row); per "
             "token: each gap over the tokens it delivered; auto aims at a round with prompt rows at most "
             f"{a.stall:g}x one without:", "",
             "| chunk | p50 before | p50 after | p99 after | **p99 after / p50 without it** | p99 after / p50 before "
             "| worst after | per token: p99 after / p50 without it | long prompt's first token, ms (rounds) "
             "| streams running then |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, m in summary.items():
        first = "—" if c == "none" else f"{m['long_ttft_ms']:.0f} ({m['long_rounds']:.0f}) | {m['streams_at_long_ttft']:.0f}"
        name = {"none": "no long prompt", "0": "whole prompt"}.get(c, c)
        lines.append(f"| {name} | {m['before_p50']:.1f} | {m['after_p50']:.1f} | {m['after_p99']:.1f} | "
                     f"{m['after_p99_over_without_p50']:.2f}x | {m['after_p99_over_before_p50']:.2f}x | "
                     f"{m['after_max']:.0f} | {m['tok_after_p99_over_without_p50']:.2f}x | "
                     f"{first if c != 'none' else '— | —'} |")
    lines += ["", f"This machine's floor: one fixed plain round of the streams (a token each, one forward) "
              f"repeated 400 times took p50 {floor['p50']:.2f} ms, p99 {floor['p99']:.2f} ms "
              f"({floor['p99_over_p50']:.2f}x): jitter no chunk size removes."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
