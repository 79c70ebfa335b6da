"""Three loaded copies of the target, fed like the engine feeds (200 cached tokens, 1-16 new),
interleaved call by call, the order flipping every repeat:
- "before": the lean layer as eleven kernel calls from Python, packed weights each in its own
  allocation (4 KiB pages);
- "one call": the layer as one `specstop::decoder_layer` call, weights as before;
- "one call + 2 MiB pages": that, with the packed weights gathered into one huge-page arena (the default).
Run from the repository root: .venv/bin/python reports/forward-2026-11-27-one-call/ab.py bfloat16 [threads]"""
import statistics
import sys
import time

import torch

from decoding import cpu_kernels, fast_forward, models
from decoding.cache import CachedModel, crop
from decoding.tree import TreeLayout, layout_from_k_config

dt = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
gather = cpu_kernels.gather


def load(pages, one_call):
    cpu_kernels.gather = gather if pages else (lambda ws: 0)
    m = models.load_model(models.resolve_model_dir(None), dt)
    fast_forward.set_forward(m, "lean")
    cpu_kernels.gather = gather
    if not one_call:
        for layer in m.model.layers:
            layer._lean["one_call"] = 0
    return CachedModel(m)


copies = {"one call + 2 MiB pages": load(True, True), "one call": load(False, True), "before": load(False, False)}
V, ctx, sizes = 49152, 200, (1, 2, 4, 8, 16)
prompt = [(10 + i) % V for i in range(ctx)]
for cm in copies.values():
    cm.feed(prompt[:-1], TreeLayout(()), [], 0, 0)
ms = {}
with torch.no_grad():
    for rep in range(15):
        for n in sizes:
            lay = layout_from_k_config([n - 1]) if n > 1 else TreeLayout(())
            for k in (list(copies) if rep % 2 else list(reversed(copies))):
                cm = copies[k]
                crop(cm.cache, ctx - 1)
                cm.length = ctx - 1
                t = time.perf_counter()
                cm.feed(prompt, lay, [(1 + i) % V for i in range(n - 1)], 0, n - 1)
                ms.setdefault((n, k), []).append(1e3 * (time.perf_counter() - t))
print(f"{dt}, {torch.get_num_threads()} thread(s), median of 15, ms (x before):")
print("| tokens | " + " | ".join(copies) + " |\n|---|" + "---|" * len(copies))
for n in sizes:
    b = statistics.median(ms[(n, "before")])
    print(f"| {n} | " + " | ".join(f"{statistics.median(ms[(n, k)]):.2f} ({statistics.median(ms[(n, k)]) / b:.3f}x)"
                                    for k in copies) + " |")
one = {k: statistics.median(ms[(1, k)]) for k in copies}
print("verify / step: " + ", ".join(f"{k}: " + " / ".join(f"{statistics.median(ms[(n, k)]) / one[k]:.2f}" for n in sizes[1:])
                                     for k in copies))
