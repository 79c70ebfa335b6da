"""Tokens/s of N requests batched (decoding.batch) against the batch-1 engine serving them one
after another, on the real embedded target and its shipped draft:

    python -m decoding.bench.batch --clients 1 2 4 [--max-new-tokens 48] [--json out.json]

Why: the point of one verify forward for every request is throughput at several clients; this
is the measurement, not a test (timings depend on the machine and its load). Rows, greedy:
  sequential   decoding.engine with the defaults (defaults.yaml), one request after another;
  independent  BatchEngine, each request's own tree policy (the defaults' grow rule per request);
  joint        BatchEngine, one grow budget across the requests (decoding.batch.budget, over q);
  joint-decider  the same over the registry's latest decider's scores (where one fits the pair);
  chain3       BatchEngine, a fixed chain of 3 draft tokens per request;
  ar-batched   BatchEngine with no draft: plain decoding, one row per request.
Every batched row's texts are compared with the sequential ones (greedy: equal, barring a
near-tie flipped by batched rounding; `same_text` says).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decoding.options import add_option

PROMPTS = [
    "Explain recursion to a beginner.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List three facts about the Moon.",
    "What is the difference between a list and a tuple in Python? Answer briefly with an example.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Give me a haiku about autumn rain.",
    "How do I reverse a linked list?",
    "Why is the sky blue?",
]


def _run_batched(engine, prompts, max_new, eos) -> tuple[list[list[int]], list[int]]:
    reqs = [engine.add(p, max_new, eos_token_id=eos) for p in prompts]
    engine.run()
    return [r.out for r in reqs], list(engine.verify_rows)


def _decider_budget(session, cfg, cost, layout):
    """A maker of the joint budget over the registry's latest decider (None where none fits)."""
    from decoding.batch.budget import JointGrow
    from decoding.batch.scheduler import BatchEngine

    try:
        g = session.decider_stop(None, "grow", None, cfg)
    except (ValueError, OSError) as e:  # no decider for this pair: the row is left out
        print(f"# no joint-decider row: {e}")
        return None
    return lambda: BatchEngine(session.target, session.draft, layout, budget=JointGrow(
        g.scorer, cost, max_width=max(cfg.k_levels), max_nodes=cfg.max_nodes, label="decider",
        needs_hidden=g.needs_hidden))


def bench(decoder, clients: list[int], max_new: int, repeats: int = 1) -> list[dict]:
    """One row per (clients, mode): new tokens, median seconds over `repeats` (the modes
    interleaved within each repeat, so a burst of load hits several once), tokens/s, speedup over
    sequential."""
    from decoding.batch.budget import JointGrow
    from decoding.batch.scheduler import BatchEngine
    from decoding.growth import q_scores
    from decoding.sampling import SamplingConfig
    from decoding.tree import layout_from_k_config

    s, cfg = decoder.session, decoder.config
    eos = s.eos_token_id
    ids = [decoder.prompt_ids(p, chat=True, max_new_tokens=max_new) for p in PROMPTS]
    layout = layout_from_k_config(cfg.k_levels)
    cost = s.measured_cost()
    per_request = (lambda: s.grow_policy(cfg)) if decoder._stop is not None else None
    seq_engine = decoder.engine(SamplingConfig())
    seq_engine.generate(ids[0], 4, eos)  # warm-up (kernels, caches)
    modes = {
        "sequential": None,
        "independent": lambda: BatchEngine(s.target, s.draft, layout, stop=per_request),
        "joint": lambda: BatchEngine(s.target, s.draft, layout, budget=JointGrow(
            q_scores, cost, max_width=max(cfg.k_levels), max_nodes=cfg.max_nodes)),
        "joint-decider": _decider_budget(s, cfg, cost, layout),
        "chain3": lambda: BatchEngine(s.target, s.draft, layout_from_k_config((1, 1, 1))),
        "ar-batched": lambda: BatchEngine(s.target, None),
    }
    modes = {k: v for k, v in modes.items() if k == "sequential" or v is not None}
    rows = []
    for n in clients:
        prompts = [ids[i % len(ids)] for i in range(n)]
        secs: dict[str, list[float]] = {m: [] for m in modes}
        outs, vrows = {}, {}
        for _ in range(repeats):
            for mode, make in modes.items():
                t = time.perf_counter()
                if make is None:
                    outs[mode], vrows[mode] = [seq_engine.generate(p, max_new, eos)[0] for p in prompts], []
                else:
                    outs[mode], vrows[mode] = _run_batched(make(), prompts, max_new, eos)
                secs[mode].append(time.perf_counter() - t)
        base = statistics.median(secs["sequential"]) / sum(map(len, outs["sequential"]))
        for mode in modes:
            sec, tok, vr = statistics.median(secs[mode]), sum(map(len, outs[mode])), vrows[mode]
            rows.append(dict(clients=n, mode=mode, tokens=tok, seconds=round(sec, 2),
                             spread=[round(x, 2) for x in sorted(secs[mode])], tokens_per_s=round(tok / sec, 2),
                             speedup=round(base * tok / sec, 2), same_text=outs[mode] == outs["sequential"],
                             rounds=len(vr) or None, mean_rows=round(sum(vr) / len(vr), 1) if vr else None))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_option(ap, "clients", several=True, default=[1, 2, 4])
    add_option(ap, "max_new_tokens", default=48)
    add_option(ap, "repeats", default=1)
    add_option(ap, "threads")
    # the rows as JSON (was --json, which is generate's print-JSON switch)
    add_option(ap, "out")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from decoding import Decoder

    dec = Decoder.load()
    print(f"# target {type(dec.session.target).__name__}, draft {type(dec.session.draft).__name__}, "
          f"{dec.config.name}, {torch.get_num_threads()} threads, {a.max_new_tokens} new tokens a request")
    rows = bench(dec, a.clients, a.max_new_tokens, a.repeats)
    print(f"{'clients':>7} {'mode':<12} {'tokens':>6} {'s':>7} {'tok/s':>7} {'x seq':>6} same  rounds rows/round")
    for r in rows:
        print(f"{r['clients']:>7} {r['mode']:<12} {r['tokens']:>6} {r['seconds']:>7} {r['tokens_per_s']:>7} "
              f"{r['speedup']:>6} {str(r['same_text']):<5} {r['rounds'] or '':>6} {r['mean_rows'] or ''}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
