"""The GPU suite's rows (decoding.bench.gpu_suite): HF `generate` (eager, and with its static cache
compiled), our rows on the graph forward or the device round (greedy, and the sampled ones at
T = 1), HF assisted generation; and their warm-up, which captures every graph a timed run needs."""

from __future__ import annotations

import time
from dataclasses import asdict


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load_rows(cfg):
    """The session (target + head, graph forward), the stand-alone draft and each row's runner:
    name -> callable(ids, n) -> (token ids, seconds)."""
    import torch

    from decoding.defaults import DEFAULT_DRAFT, defaults_for, strategy_config
    from decoding.models import load_model
    from decoding.models.session import Session
    from decoding.options import GROW
    from decoding.sampling import SamplingConfig

    # the shipped head unless named (Session.open adds it only for the embedded target, not its GGUF file)
    sess = Session.open(cfg.target, cfg.head or DEFAULT_DRAFT, dtype=cfg.dtype, device=cfg.device, forward=cfg.forward)
    greedy = SamplingConfig()
    eos = sess.eos_token_id
    target = sess.target

    def hf(assistant=None):
        def run(ids, n):
            x = torch.tensor([ids], device=target.device)
            kw = {"assistant_model": assistant} if assistant is not None else {}
            _sync(cfg.device)
            t = time.perf_counter()
            with torch.inference_mode():
                y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None, **kw)
            _sync(cfg.device)
            return y[0, len(ids):].tolist(), time.perf_counter() - t
        return run

    def ours(engine):
        def run(ids, n):
            _sync(cfg.device)
            t = time.perf_counter()
            out, st = engine.generate(ids, n, eos, seed=len(ids))
            _sync(cfg.device)
            run.last_rounds = st.rounds
            return out, time.perf_counter() - t
        run.engine = engine
        return run

    def hf_compiled():
        import copy

        from decoding.forward.packed import set_forward

        model = copy.deepcopy(target)
        set_forward(model, "eager")
        for m in model.modules():  # the copies of our caches' taps belong to the original
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks_with_kwargs.clear()
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)

        def run(ids, n):
            x = torch.tensor([ids], device=model.device)
            _sync(cfg.device)
            t = time.perf_counter()
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                   cache_implementation="static", eos_token_id=eos,
                                   pad_token_id=eos if isinstance(eos, int) else None)
            _sync(cfg.device)
            return y[0, len(ids):].tolist(), time.perf_counter() - t
        return run

    entry = defaults_for(cfg.device)
    rows = {"hf-generate": hf()}
    specs = {"ar": {"strategy": "ar"}}
    if entry.strategy != "ar":  # else the ar row is the default
        specs["default"] = {k: v for k, v in asdict(entry).items() if k not in ("dtype", "source", "measured")}
    for c in cfg.candidates:
        sc = strategy_config(entry, c["strategy"], {k: v for k, v in c.items() if k != "strategy"})
        specs[sc.name + (f"<={sc.max_nodes}" if GROW in (sc.confidence_rule, c.get("decider_rule")) else "")] = dict(c)
    for name, spec in specs.items():
        opts = {k: v for k, v in spec.items() if k not in ("strategy", "decider_rule")}
        sc = strategy_config(entry, None, {}) if name == "default" else strategy_config(entry, spec["strategy"], opts)
        rows[name] = ours(sess.engine(sc, greedy, rule=spec.get("decider_rule")))
        rows[name].spec = spec
        if name in cfg.sampled:
            rows[name + "@T1"] = ours(sess.engine(sc, SamplingConfig(temperature=1.0), rule=spec.get("decider_rule")))
            rows[name + "@T1"].spec = dict(spec, temperature=1.0)
    if cfg.hf_compiled and cfg.device.startswith("cuda"):
        rows["hf-generate-static-compiled"] = hf_compiled()
    if cfg.draft:
        d = load_model(cfg.draft, cfg.dtype, cfg.device)
        rows["hf-assisted"] = hf(d)
    return sess, rows


def warm(rows: dict, ids, cfg, clock, failed: dict) -> None:
    """One short run per row (kernels, allocator), then every graph the runs will need, captured
    now (columns up to the longest prompt + tokens + tree). A row that raises is dropped."""
    for name, run in rows.items():
        if name == "hf-generate-static-compiled" and clock.left() < 0.6 * cfg.budget_s:
            failed[name] = "skipped: its compile did not fit the budget"
            continue
        try:
            run(ids, 8)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            clock.say(f"{name} failed: {failed[name]}")
            continue
        eng = getattr(run, "engine", None)
        m = getattr(eng, "target", None)
        if hasattr(eng, "precapture"):  # a device round: every column bucket of the longest run
            n = eng.precapture(ids, len(ids) + max(cfg.new_tokens) + 64)
            clock.say(f"warm {name}: {n} graphs")
        elif m is not None and hasattr(m, "precapture"):
            n = m.precapture(len(ids) + max(cfg.new_tokens) + 128, taps=getattr(eng.proposer, "verifying", None) is not None)
            clock.say(f"warm {name}: {n} graphs")
