"""decoding.bench.launches: the ops a round dispatches outside the forwards a CUDA graph would
replay, counted by phase on the static forward (what the GPU's per-round overhead is judged by)."""

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.models import noisy_copy, tiny_llama
from decoding.bench import launches
from decoding.forward import static
from decoding.forward.packed import set_forward
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine


def static_pair():
    target = tiny_llama(0, vocab=40, layers=3, hidden=32, scale=6)
    out = [copy.deepcopy(target), noisy_copy(target, 0.003)]
    for m in out:
        set_forward(m, "static")
    return out


def test_rounds_are_counted_by_phase_without_the_forwards():
    target, draft = static_pair()
    prompts = [[1, 2, 3], [5, 6, 7, 8]]
    ar = launches.per_round(build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig()), prompts, 12)
    spec = launches.per_round(build_engine(target, draft, StrategyConfig(strategy="ti-mcsd", width=2, depth=3),
                                           SamplingConfig()), prompts, 12)
    assert ar["rounds"] == 24 and ar["tokens_per_round"] == 1.0 and "propose" not in ar["by_phase"]
    assert {"propose", "verify", "decide", "commit"} <= set(spec["by_phase"])
    assert spec["tokens_per_round"] > 1.0 and 0 < spec["kernels_per_round"] < spec["ops_per_round"]
    assert spec["device_kernels_per_round"] == 0  # a CPU run: nothing is off the CPU
    # a 3-layer forward alone dispatches far more than ar's whole round outside it
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Count():
        target(torch.tensor([[1, 2, 3]]))
    assert Count.n > 2 * ar["ops_per_round"] > 0


def test_counting_leaves_no_patch_behind():
    before = (static.StaticCachedModel._run, static.StaticCachedModel.feed, static.StaticCachedModel.commit)
    with launches.counting() as c:
        torch.zeros(3)[:2] + 1
        torch.zeros(3, device="meta") + 1  # off the CPU: what a GPU run counts as launches
    assert sum(c.ops["other"].values()) == 5 and c.views == {"slice"} and c.on_device == 2
    assert (static.StaticCachedModel._run, static.StaticCachedModel.feed, static.StaticCachedModel.commit) == before
