"""One process, one model copy, in turn: the default's grow rule with and without the cost curve's
context term, with the measured choice too (at 285f282, where the engine had one), and ar
(`python inproc2.py`): decode tok/s after the prompt (prefill timed apart), medians of 3 turns."""
import dataclasses, statistics, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.batch.bench import PROMPTS
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
import decoding
dec = Decoder.load()
s = SamplingConfig()
spec = dec.engine(s)
saved, curve = getattr(spec, "measured", None), spec.stop.cost  # (measured: the engine of 285f282 only)
flat = dataclasses.replace(curve, key_sizes=[], target_key_ms=[], draft_key_ms=[])
ar = build_engine(dec.session.target, None, StrategyConfig(strategy="ar"), s)
eos = dec.session.eos_token_id
text = open(decoding.__file__.replace("__init__.py", "engine.py")).read()
full = dec.prompt_ids("Summarise what this code does:\n" + text, chat=True, max_new_tokens=128)
sets = {"chat x8": [dec.prompt_ids(p, chat=True, max_new_tokens=96) for p in PROMPTS],
        "600": [full[-600:], full[-650:]], "1200": [full[-1200:], full[-1250:]]}
spec.generate(full[:64], 8, eos); ar.generate(full[:64], 8, eos)
def rate(eng, ids):
    n, t = 0, 0.0
    for p in ids:
        a = time.perf_counter(); eng.generate(p, 1, eos); pre = time.perf_counter() - a
        a = time.perf_counter(); out, st = eng.generate(p, 96, eos); t += time.perf_counter() - a - pre; n += len(out) - 1
    return n / t
MODES = {"no context term": (flat, None), "context term": (curve, None), **({"shipped (+measured)": (curve, saved)} if saved else {})}
for name, ids in sets.items():
    res = {m: [] for m in [*MODES, "ar"]}
    for turn in range(3):
        for mode in res:
            if mode == "ar":
                res[mode].append(rate(ar, ids))
            else:
                spec.stop.cost, spec.measured = MODES[mode]
                res[mode].append(rate(spec, ids))
    print(name, {k: f"{statistics.median(v):.1f} ({' '.join(f'{x:.0f}' for x in v)})" for k, v in res.items()}, flush=True)
