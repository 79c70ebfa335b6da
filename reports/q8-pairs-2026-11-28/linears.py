"""The embedded target's 121 quantized linears (q/k/v and gate/up concatenated as the layer runs
them, the tied Q8_0 output layer last) called back to back from Python at T rows, 2 threads, best of
15; random x. Python's dispatch (~2.5 us a call) is in the figure, the layer op's is not.

    python reports/q8-pairs-2026-11-28/linears.py 1 4 8 16 64
"""
import sys, time, torch
from transformers import AutoConfig
from decoding.models.named_targets import smollm2_gguf_path, gguf_target_dir
from decoding.forward import quant
torch.set_num_threads(2)
g = smollm2_gguf_path()
cfg = AutoConfig.from_pretrained(gguf_target_dir(g)) if gguf_target_dir(g).exists() else None
print(g, cfg is not None)
ws = quant.read_gguf(g, cfg)
# group q/k/v and gate/up like the model does
lays = {}
for n, w in ws.items():
    if n.startswith("model.layers"):
        lays.setdefault(int(n.split(".")[2]), {})[n.split(".")[-2]] = w
lin = []
for i, d in sorted(lays.items()):
    lin.append(quant.QuantWeight.cat([d["q_proj"], d["k_proj"], d["v_proj"]]))
    lin.append(d["o_proj"])
    lin.append(quant.QuantWeight.cat([d["gate_proj"], d["up_proj"]]))
    lin.append(d["down_proj"])
lin.append(ws.get("lm_head.weight") or ws["model.embed_tokens.weight"])
nbytes = sum(w.packed().numel() for w in lin)
print("linears", len(lin), "MB", nbytes / 1e6, "kinds", {w.kind for w in lin})
macs = sum(w.n * w.k for w in lin)
for T in [int(t) for t in sys.argv[1:]] or [1, 2, 4, 8, 16]:
    xs = [torch.randn(T, w.k) for w in lin]
    best = 1e9
    for rep in range(15):
        t = time.perf_counter()
        for w, x in zip(lin, xs):
            w(x)
        best = min(best, time.perf_counter() - t)
    print(f"T={T:3d} {best*1e3:6.2f} ms  {nbytes/best/1e9:5.1f} GB/s  {macs*T/best/1e9:6.1f} GMAC/s")
