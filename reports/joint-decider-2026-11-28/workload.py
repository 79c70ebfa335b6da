"""The serve suite's workload in process, shared by this folder's scripts: N slots, slot c taking
prompts c, c + N, ... in turn (as the suite's clients do), greedy, no HTTP."""
import time


def serve_workload(engine, ids, n, eos, new_tokens=96):
    """(tok/s, the engine) after every prompt of `ids` ran through `engine` n at a time."""
    queue = [ids[i::n] for i in range(n)]
    live, tokens = {}, 0

    def admit(c):
        if queue[c]:
            live[c] = engine.add(queue[c].pop(0), new_tokens, eos_token_id=eos)
    t = time.perf_counter()
    for c in range(n):
        admit(c)
    while live:
        done = {id(r) for r in engine.step()}
        for c, r in list(live.items()):
            if id(r) in done:
                tokens += len(r.out)
                del live[c]
                admit(c)
    return tokens / (time.perf_counter() - t), tokens


def in_turn(modes, run, clients, describe, turns=3):
    """Every mode in turn, `turns` times, per client count; a line a mode: median tok/s, each turn's,
    and describe(the first turn's run() result)."""
    import statistics

    for n in clients:
        res = {m: [] for m in modes}
        for _ in range(turns):
            for m, make in modes.items():
                res[m].append(run(make, n))
        for m, v in res.items():
            tps = [x[0] for x in v]
            print(f"clients {n} {m:<40} {statistics.median(tps):6.1f} tok/s ({' '.join(f'{x:.0f}' for x in tps)}), "
                  f"{describe(v[0])}", flush=True)


def loaded():
    """The default Decoder, its session and config, the suite's 16 prompts as ids, eos, the largest
    tree's layout and this machine's cost curve."""
    from decoding import Decoder
    from decoding.bench.serve_suite import held_out
    from decoding.tree import layout_from_k_config

    dec = Decoder.load()
    s, cfg = dec.session, dec.config
    ids = [dec.prompt_ids(t, chat=True, max_new_tokens=96) for t in held_out(16)]
    return dec, s, cfg, ids, s.eos_token_id, layout_from_k_config(cfg.k_levels), s.measured_cost()
