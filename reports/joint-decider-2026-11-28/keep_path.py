"""keep_path on the embedded target's cache (30 layers, 200 cached tokens, a tree of 8 fed, 3 kept):
the one-call kernel (layers a kernel wrote) against the per-layer moves (views made), us a call."""
import time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.kv_cache import keep_path
dec = Decoder.load(strategy="ar")
like = torch.zeros(1, 3, 1, 64)
def fresh():
    from decoding.kv_cache import new_cache
    c = new_cache(dec.session.target.model)
    for i, layer in enumerate(c.layers):
        kb, vb, start, n = layer.room(like, 208)
        kb[..., start:start + 208, :] = torch.randn(1, 3, 208, 64)
        layer.grown(start, n + 208)
    return c
for turn in range(5):
    out = {}
    for mode in ("one call", "per layer"):
        caches = [fresh() for _ in range(20)]
        for c in caches:  # touch every buffer: time the moves, not first-touch page faults
            for layer in c.layers:
                layer._kb.add_(0); layer._vb.add_(0)
        if mode == "per layer":
            for c in caches:
                for layer in c.layers:
                    layer.keys
        t = time.perf_counter()
        for c in caches:
            keep_path(c, 200, [0, 4, 6], 8)
        out[mode] = 1e6 * (time.perf_counter() - t) / len(caches)
    print(" ".join(f"{k}: {v:.0f} us" for k, v in out.items()), flush=True)
