"""The target's verify cost by rows on this CPU (decoding.forward.cost.time_forwards: one request,
256 cached tokens, best of 5), twice: `python verify_cost.py`."""
import torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.forward.cost import time_forwards
dec = Decoder.load(); s = dec.session
sizes = [1, 2, 4, 8, 16, 32, 64]
for rep in range(2):
    ms = time_forwards(s.target, sizes, repeats=5, context=256)
    print(" ".join(f"{n}:{m:.2f}" for n, m in zip(sizes, ms)), "| ratio to 1 row:", " ".join(f"{m/ms[0]:.2f}" for m in ms), flush=True)
