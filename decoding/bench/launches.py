"""What a round dispatches outside the captured forwards, by phase: the GPU's per-round overhead,
counted on any device.

On a GPU under `--forward graph` a target or head forward is one graph replay; every other torch
op of a round (building the tree, the head's top-k, the masks, the acceptance, the KV rollback)
is its own dispatch and, on a CUDA tensor, its own kernel launch; a `.item()` / `.tolist()` is a
sync that stalls the launch queue. On the H100 of reports/gpu-2026-11-27 a forward costs 3.2 ms
captured and 65 ms eager, i.e. tens of microseconds per eager op: at hundreds of ops a round,
that overhead is what makes the speculative rows lose to graph-captured `ar` there. This counts
those ops (aten calls, from a TorchDispatchMode) per round and per phase (propose, verify,
decide, commit and the rest), with the forwards a graph would replay left out, so a change can be
judged on a CPU before a device run times it:

    python -m decoding.bench.launches                     # the embedded target + head, static forward
    python -m decoding.bench.launches --dtype float32 --prompts 1 --new-tokens 32
"""

from __future__ import annotations

import collections
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ITEM_READS = ("_local_scalar_dense", "item")
"""aten ops of a `.item()` / `float(t)`: each waits for the device."""
HOST_READS = (*ITEM_READS, "tolist")
"""Every read of device data: the aten reads and `.tolist()` calls (counted by a patch, as they
dispatch no aten op)."""


def launches(name: str, is_view: bool) -> bool:
    """Whether an op is work on a device (a kernel, or a host tensor copied over): views only
    re-describe memory; `lift_fresh` is a `torch.tensor(...)` of host data, a copy on a GPU."""
    return not is_view or name == "lift_fresh"


def _off_cpu(a) -> bool:
    """A tensor, or a factory's `device=`, off the CPU."""
    if isinstance(a, torch.Tensor):
        return a.device.type != "cpu"
    return isinstance(a, torch.device) and a.type != "cpu"


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.inside, self.phase = 0, "other"
        self.ops = collections.defaultdict(collections.Counter)
        self.views: set[str] = set()
        self.on_device = 0
        """Non-view ops with a tensor off the CPU: the launches themselves (0 on a CPU run)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = func.overloadpacket.__name__
            self.ops[self.phase][name] += 1
            if func.is_view:
                self.views.add(name)
            elif any(_off_cpu(a) for a in tree_leaves((args, kwargs))):
                self.on_device += 1
        return func(*args, **(kwargs or {}))


def _wrap(owner, name: str, enter):
    orig = getattr(owner, name)

    def wrapped(*a, **k):
        with enter():
            return orig(*a, **k)
    setattr(owner, name, wrapped)
    return orig


@contextmanager
def counting():
    """Count the aten ops dispatched inside the block: yields the counter (`.ops`: {phase:
    Counter(op -> calls)}, `.views`: the op names that were views). The static caches' forwards
    (what a graph replays) are left out; patches are undone on exit."""
    from decoding import engine
    from decoding.drafts import head_graph
    from decoding.forward import static
    from decoding.round.engine import RoundEngine
    from decoding.round.runner import DeviceRound

    c = _Counter()

    @contextmanager
    def replayed():
        c.inside += 1
        try:
            yield
        finally:
            c.inside -= 1

    def phase(name):
        @contextmanager
        def enter():
            old = c.phase
            c.phase = old if old == "prefill" else name  # a prompt's forward stays the prompt's
            try:
                yield
            finally:
                c.phase = old
        return enter

    E = engine.SpeculativeEngine
    patches = [(static.StaticCachedModel, "_run", replayed), (head_graph.HeadGraphs, "_run", replayed),
               (E, "_propose", phase("propose")), (E, "_decide", phase("decide")),
               (static.StaticCachedModel, "feed", phase("verify")), (static.StaticCachedModel, "commit", phase("commit")),
               (RoundEngine, "run", replayed), (DeviceRound, "prefill", phase("prefill"))]
    saved = [(owner, name, _wrap(owner, name, enter)) for owner, name, enter in patches]
    tolist = torch.Tensor.tolist

    def reading(self, *a, **k):  # a read of device data (a sync on a GPU); no aten op to count
        if not c.inside:
            c.ops[c.phase]["tolist"] += 1
        return tolist(self, *a, **k)
    torch.Tensor.tolist = reading
    try:
        with c:
            yield c
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
        torch.Tensor.tolist = tolist


def per_round(engine, prompts: list[list[int]], new_tokens: int, eos=None) -> dict:
    """{"rounds", "tokens_per_round", "ops_per_round", "kernels_per_round" (ops that are not views:
    launches on a GPU where their tensors live there), "device_kernels_per_round" (those that
    touched a tensor off the CPU: on a GPU run, the launches counted), "item_reads_per_round",
    "host_reads_per_round" (reads of device data outside a prompt's forward: item reads and
    `.tolist()` calls), "by_phase": {phase: kernels per round}, "top": {phase: [(op, kernels per round)]}} over
    `prompts` (token ids)."""
    rounds = tokens = 0
    with counting() as c:
        for ids in prompts:
            _, st = engine.generate(ids, new_tokens, eos)
            rounds, tokens = rounds + st.rounds, tokens + st.new_tokens
    r = max(1, rounds)
    ops = c.ops
    work = {p: collections.Counter({k: n for k, n in v.items() if launches(k, k in c.views) and k != "tolist"})
            for p, v in ops.items()}
    return {"rounds": rounds, "tokens_per_round": tokens / r,
            "ops_per_round": sum(sum(v.values()) for v in ops.values()) / r,
            "kernels_per_round": sum(sum(v.values()) for v in work.values()) / r,
            "device_kernels_per_round": c.on_device / r,
            "item_reads_per_round": sum(v[s] for v in ops.values() for s in ITEM_READS) / r,
            "host_reads_per_round": sum(v[s] for p, v in ops.items() if p != "prefill" for s in HOST_READS) / r,
            "by_phase": {p: sum(v.values()) / r for p, v in sorted(work.items())},
            "top": {p: [(k, n / r) for k, n in v.most_common(6)] for p, v in sorted(work.items())}}


SUMMARY = ("tokens_per_round", "kernels_per_round", "device_kernels_per_round", "item_reads_per_round",
           "host_reads_per_round", "by_phase")


def for_rows(engines: dict, prompts: list[list[int]], new_tokens: int, eos, left) -> dict:
    """per_round (its SUMMARY keys) for each named engine while `left()` (seconds) stays above 20:
    the GPU suite's part after its timed runs (counting slows every op, so it is never timed)."""
    out = {}
    for name, eng in engines.items():
        if left() < 20:
            break
        r = per_round(eng, prompts, new_tokens, eos)
        out[name] = {k: r[k] for k in SUMMARY}
    return out


ROWS = {"ar": ("ar", {}), "sd[g=3]": ("sd", {"gamma": 3}), "ti-mcsd[W=4,D=6]": ("ti-mcsd", {"width": 4, "depth": 6}),
        "ti-mcsd[W=4,D=8]+confidence(grow)<=64": ("ti-mcsd", {"width": 4, "depth": 8, "stop": "confidence",
                                                          "confidence_rule": "grow", "max_nodes": 64})}
"""The GPU suite's rows (decoding.bench.gpu_suite), by the names its report gives them."""


def main(argv=None) -> int:
    import argparse
    import sys

    from decoding.bench.config import load_prompts
    from decoding.defaults import DEFAULT_DRAFT, defaults_for, strategy_config
    from decoding.models import ModelError
    from decoding.models.session import Session
    from decoding.options import add_option, add_options
    from decoding.sampling import SamplingConfig

    ap = argparse.ArgumentParser(prog="python -m decoding.bench.launches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap, "target", "head", "device")
    add_option(ap, "dtype", default="bfloat16")
    add_option(ap, "forward", unset="static on a CPU, graph on CUDA")
    add_option(ap, "prompts", default=2)
    add_option(ap, "new_tokens", default=96)
    a = ap.parse_args(argv)
    forward = a.forward or ("graph" if a.device.startswith("cuda") else "static")
    try:
        sess = Session.open(a.target, a.head or DEFAULT_DRAFT, dtype=a.dtype, device=a.device, forward=forward)
        prompts = [sess.encode(p["prompt"], chat=True) for f in ("heldout_general", "heldout_code")
                   for p in load_prompts(f"data/prompts/{f}.jsonl", a.prompts)]
    except (ModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    entry = defaults_for(a.device)
    print(f"{a.device} {a.dtype}, {forward} forward, {len(prompts)} prompts x {a.new_tokens} tokens; "
          f"ops a round dispatches outside the captured forwards")
    for name, (strategy, opts) in ROWS.items():
        eng = sess.engine(strategy_config(entry, strategy, opts), SamplingConfig())
        eng.generate(prompts[0], 8, sess.eos_token_id)  # warm: first-call allocations are not a round's
        r = per_round(eng, prompts, a.new_tokens, sess.eos_token_id)
        phases = ", ".join(f"{p} {n:.0f}" for p, n in r["by_phase"].items())
        print(f"{name:40s} tokens/round {r['tokens_per_round']:.2f}  ops/round {r['ops_per_round']:.0f}, of which "
              f"kernels {r['kernels_per_round']:.0f} ({phases}); .item() reads {r['item_reads_per_round']:.1f}")
        for p, top in r["top"].items():
            print(f"    {p:8s} " + ", ".join(f"{k} {n:.1f}" for k, n in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
