"""The target's 121 quantized linears called one by one from Python at 1 / 4 / 16 rows (median of
7 passes; a call's Python overhead included): ms and GB/s of panel bytes per kind.
`python linears.py [threads]`."""
import time, torch, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from decoding import Decoder
dec = Decoder.load(strategy="ar")
m = dec.session.target
ws = []
for layer in m.model.layers:
    f = layer._lean
    for name in ("qkv", "o", "gate_up", "down"):
        ws.append((name, f[name].few))
head = getattr(m.get_output_embeddings(), "_few", None)
print(type(ws[0][1]).__name__, type(head).__name__)
ws.append(("lm_head", head))
by = {}
for T in (1, 4, 16):
    tot = []
    for rep in range(7):
        per = {}
        t0 = time.perf_counter()
        for name, w in ws:
            x = torch.randn(T, w.k)
            t = time.perf_counter(); w(x); per[name] = per.get(name, 0) + time.perf_counter() - t
        tot.append((time.perf_counter() - t0, per))
    tot.sort(key=lambda z: z[0])
    wall, per = tot[3]
    nbytes = {n: sum(w.packed().numel() for nn, w in ws if nn == n) for n in per}
    print(f"T={T}: all linears {1e3*wall:.2f} ms; " + ", ".join(f"{n} {1e3*s:.2f} ms ({nbytes[n]/s/1e9:.0f} GB/s)" for n, s in per.items()))
