"""The target's and the draft's cost per forward on this machine (the cost curve), timed in
place: what the grow rule and the decider's threshold replay price a tree with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch


TOKENS, NODES = "tokens", "nodes"
"""Cost curve units: sizes count the new tokens a forward feeds, or (curves stored before
2026-11-26) tree nodes."""


@dataclass
class CostCurve:
    """Milliseconds per forward by number of tokens fed (the `cost_model` `training.decider.fit`
    measures and stores with a decider: training.decider.replay.CostModel's fields)."""

    sizes: list[int]
    target_ms: list[float]
    draft_ms: list[float]
    overhead_ms: float = 0.0
    """A round with a tree: its fixed host cost beyond the forwards and the levels (the proposer's
    setup, the layout, the walk over the verified rows; decoding.growth.time_host_work)."""
    policy_ms: float = 0.0
    """A drafted level's host work per parent (a level of P parents costs P times it): warp,
    top-k and scores, draws, tree bookkeeping."""
    unit: str = TOKENS
    """What a size counts: see `at`."""
    context: int = 0
    """Cached tokens the curve was timed after (0: not recorded, no context term)."""
    key_sizes: list[int] = field(default_factory=list)
    target_key_ms: list[float] = field(default_factory=list)
    draft_key_ms: list[float] = field(default_factory=list)
    """ms a forward of key_sizes[i] tokens adds per cached token beyond `context`: every row reads
    every cached key, so a verify of many rows costs more at a long context than the curve says
    (1,328 cached tokens, 2-core EPYC: 8 rows' attention 5.0 ms a forward, a step's 1.5)."""
    far_context: int = 0
    """Cached tokens from which the far slopes apply instead (0: one slope at every context)."""
    target_far_key_ms: list[float] = field(default_factory=list)
    draft_far_key_ms: list[float] = field(default_factory=list)
    """ms per cached token beyond `far_context` (key_sizes as above): the cost per key is not one
    line. On an AVX2 Zen 3 (2 threads, GGUF target) a step timed 6.8 / 11.8 / 18.7 ms at 256 /
    1,280 / 2,400 cached tokens and a 3-token verify 7.9 / 16.4 / 22.1: the line through the first
    two priced them 14.4 and 20.3 at 2,400, so a chain looked 1.41x a step where it cost 1.18x
    and the grow rule sized 0-2 nodes where sd g2 ran 1.25x `ar`."""
    _shifted: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        keys = ("sizes", "target_ms", "draft_ms")
        if not isinstance(d, dict) or any(not d.get(k) for k in keys) \
                or not len(d["sizes"]) == len(d["target_ms"]) == len(d["draft_ms"]):
            raise ValueError("a cost model needs equal-length sizes, target_ms and draft_ms "
                             f"(got {sorted(d) if isinstance(d, dict) else d!r})")
        ks = [list(d.get(k) or []) for k in ("key_sizes", "target_key_ms", "draft_key_ms")]
        if not len(ks[0]) == len(ks[1]) == len(ks[2]):
            raise ValueError("a cost model's key_sizes, target_key_ms and draft_key_ms need equal lengths")
        far = int(d.get("far_context", 0))  # 0 or absent (curves stored before it): one slope
        fs = [[float(x) for x in d.get(k) or []] if far else [] for k in ("target_far_key_ms", "draft_far_key_ms")]
        if far < 0 or (far and not len(fs[0]) == len(fs[1]) == len(ks[0])):
            raise ValueError("a cost model's far_context needs target_far_key_ms and draft_far_key_ms, one per key size")
        return cls(list(d["sizes"]), [float(x) for x in d["target_ms"]], [float(x) for x in d["draft_ms"]],
                   float(d.get("overhead_ms", 0.0)), float(d.get("policy_ms", 0.0)), d.get("unit", NODES),
                   int(d.get("context", 0)), [int(x) for x in ks[0]], [float(x) for x in ks[1]],
                   [float(x) for x in ks[2]], far_context=far, target_far_key_ms=fs[0], draft_far_key_ms=fs[1])

    def at_context(self, cached: int) -> CostCurve:
        """The curve for forwards after `cached` tokens: the per-key term added to every size. The
        same curve where no term was timed, and at or below the context it was timed at (read
        lower, the line priced rows under their timed cost; on 50-250-token chat prompts the
        default then looked 3-11% slower, inside the noise of a process: not done)."""
        if not self.key_sizes or not self.context:
            return self
        cached = cached // 16 * 16  # rounds each read one of few curves (kept: one a step of 16)
        if cached <= self.context:
            return self
        if cached not in self._shifted:
            far = max(cached - self.far_context, 0) if self.far_context else 0
            near = cached - self.context - far

            def shift(ms, per_key, far_key):
                slope = np.interp(self.sizes, self.key_sizes, per_key)
                far_slope = np.interp(self.sizes, self.key_sizes, far_key) if far else slope
                return monotone([m + near * k + far * f for m, k, f in zip(ms, slope, far_slope)])

            self._shifted[cached] = replace(
                self, target_ms=shift(self.target_ms, self.target_key_ms, self.target_far_key_ms),
                draft_ms=shift(self.draft_ms, self.draft_key_ms, self.draft_far_key_ms), context=cached,
                key_sizes=[], far_context=0, target_far_key_ms=[], draft_far_key_ms=[])
        return self._shifted[cached]

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "target_ms": self.target_ms, "draft_ms": self.draft_ms, "unit": self.unit,
                "overhead_ms": self.overhead_ms, "policy_ms": self.policy_ms,
                "context": self.context, "key_sizes": self.key_sizes, "target_key_ms": self.target_key_ms,
                "draft_key_ms": self.draft_key_ms, "far_context": self.far_context,
                "target_far_key_ms": self.target_far_key_ms, "draft_far_key_ms": self.draft_far_key_ms}

    def target(self, n: int) -> float:
        return float(at(n, self.sizes, self.target_ms, self.unit))

    def draft(self, n: int) -> float:
        return float(at(n, self.sizes, self.draft_ms, self.unit))


def at(n, sizes, ms, unit: str):
    """A curve's ms for a forward of n new tokens (pending included; n may be an array). Curves
    timed before 2026-11-26 carry no unit: their size counted tree NODES, one pending token more
    than it says, so they are read one size lower (a 1-token step is then read as a 2-token one)."""
    if unit not in (TOKENS, NODES):
        raise ValueError(f"cost curve unit must be {TOKENS} or {NODES} (got {unit!r})")
    return np.interp(np.subtract(n, 1) if unit == NODES else n, sizes, ms)


def monotone(ms: list[float]) -> list[float]:
    """Non-decreasing in the number of tokens: a forward of more tokens never costs less, so a
    smaller size's time is capped by every larger size's (a noise burst on a shared machine
    inflates one size's median; a larger size's time is an upper bound for it)."""
    out = list(ms)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


COST_SIZES = (*range(1, 17), 20, 24, 32, 48, 64)
"""Forward sizes a cost curve is timed at: every size up to 16, where CPU kernels jump (float32
on a 2-core Xeon: about 42 ms for 3 tokens, 57 for 4), then sparser (the curve is smooth there)."""


def fit_context(model, context: int, sizes, repeats: int) -> int:
    """The context time_forwards times after: within the model's positions (learned positions
    end there; each forward commits its pending token, so the context grows by one a forward)."""
    from decoding.drafts.feature import FeatureDraft

    limit = None if isinstance(model, FeatureDraft) else getattr(model.config, "max_position_embeddings", None)
    return max(2, min(context, limit - max(sizes) - (repeats + 1) * len(sizes))) if limit else context


@torch.inference_mode()
def time_forwards(model, sizes, repeats: int = 3, context: int = 256, verify: bool = True) -> list[float]:
    """Median ms of one forward of n NEW TOKENS after `context` tokens, for each n: the pending
    committed token plus n - 1 tree nodes (n = 1 is a plain decoding step), the unit the cost
    curve is read in (`target(1 + nodes)`); `verify`: as the engine verifies (batch.forward.feed_one:
    the whole-stack call where it runs), else as a draft model is fed (CachedModel.feed). Sizes are
    interleaved within each repeat, so a burst of load hits several sizes once; the first pass
    warms up and is dropped; the result is made non-decreasing in n."""
    from decoding.forward.static import cached_model
    from decoding.batch.forward import feed_one
    from decoding.drafts.feature import FeatureDraft
    from decoding.tree import TreeLayout, layout_from_k_config

    if isinstance(model, FeatureDraft):
        return _time_feature_head(model, sizes, repeats, context)
    if min(sizes) < 1:
        raise ValueError(f"forward sizes must be >= 1 (got {sorted(sizes)})")
    vocab = model.get_output_embeddings().weight.shape[0]
    context = fit_context(model, context, sizes, repeats)
    seq = [(10 + i) % vocab for i in range(context - 1)]
    m = cached_model(model)
    m.feed(seq, TreeLayout(()), [], 0, 0)  # the context once (a prompt's forward per size cost ~20 s)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):
        for n in sizes:
            # n - 1 siblings: the mask / positions of a real tree
            lay = layout_from_k_config([n - 1]) if n > 1 else TreeLayout(())
            seq.append((10 + len(seq)) % vocab)
            t = time.perf_counter()
            toks = [(1 + i) % vocab for i in range(n - 1)]
            feed_one(m, seq, lay, toks) if verify else m.feed(seq, lay, toks, 0, n - 1)
            times[n].append(1000 * (time.perf_counter() - t))
            m.commit([], n - 1)  # drop the nodes, keep the pending token
    return monotone([float(np.median(times[n][1:])) for n in sizes])


@torch.inference_mode()
def _time_feature_head(head, sizes, repeats: int, context: int) -> list[float]:
    """time_forwards for a feature (EAGLE-3) head: one tree level of n nodes after `context`
    committed entries, as FeatureProposer drafts it (head step, lean or graphed where it runs, with the tree mask; q over
    the head's vocabulary, scattered to the target's). The features are random: the cost does not depend on them."""
    from decoding.drafts.head_graph import head_cache, head_step
    from decoding.tree import layout_from_k_config

    c, dev, dt = head.config, head.fc.weight.device, head.fc.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    cache = head_cache(head)
    toks = (torch.arange(context + max(sizes)) % c.draft_vocab_size).to(dev)[None]
    aux = torch.randn(1, context, 3 * c.target_hidden_size, generator=g).to(device=dev, dtype=dt)
    head_step(head, cache, toks[:, :context], head.fuse(aux), torch.arange(context, device=dev)[None])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):
        for n in sizes:
            lay = layout_from_k_config([n])
            mask = torch.cat((torch.ones(n, context, dtype=torch.bool), lay.mask[:n, :n]), 1)
            hid = torch.randn(1, n, c.hidden_size, generator=g).to(device=dev, dtype=dt)
            pos = torch.full((1, n), context, device=dev)
            t = time.perf_counter()
            logits, _ = head_step(head, cache, toks[:, context: context + n], hid, pos, mask)
            head.to_target(torch.softmax(logits[0].float(), -1), 0.0)
            times[n].append(1000 * (time.perf_counter() - t))
            cache.crop(context)
    return monotone([float(np.median(times[n][1:])) for n in sizes])


CONTEXTS = (256, 1280, 2560)
"""Cached tokens a curve is timed after: every size at the first, KEY_SIZES at the others too
(the slope per cached key up to the second, and the far slope beyond it)."""
KEY_SIZES = (1, 2, 4, 8, 16, 32, 64)


def per_key(sizes, ms, key_sizes, long_ms, span: int) -> list[float]:
    """ms per cached key at key_sizes: (the time at the long context - the curve's) / span,
    non-negative and non-decreasing in the tokens fed (a row never reads keys for less)."""
    base = np.interp(key_sizes, sizes, ms)
    return monotone([max(float(b2 - b1) / span, 0.0) for b1, b2 in zip(base, long_ms)])


def measure_cost(target, draft, sizes=COST_SIZES, repeats: int = 3, contexts=CONTEXTS,
                 key_sizes=KEY_SIZES, host_work=None) -> CostCurve:
    """This machine's cost curve, in the dtype the models are in (18 s for the embedded GGUF
    target on an AVX2 Zen 3, 2 threads; 7.5 s without the third context, whose prompt of 2,560
    tokens takes most of the rest): every size after contexts[0] cached tokens, key_sizes after
    contexts[1] (and contexts[2], where given and the models have the positions) too, and, with
    `host_work` (decoding.growth.time_host_work: the round's own code, which this room may not
    import), the host work of a level and of a tree round (else 0)."""
    sizes, ks = list(sizes), [n for n in key_sizes if n <= max(sizes)]
    short, long, *beyond = (min(fit_context(m, c, sizes, repeats) for m in (target, draft)) for c in contexts)
    from decoding.drafts.feature import FeatureDraft

    own = draft.config.draft_vocab_size if isinstance(draft, FeatureDraft) else None  # drawn over its own columns
    host = {} if host_work is None else dict(zip(("policy_ms", "overhead_ms"), host_work(
        target.get_output_embeddings().weight.shape[0], repeats=max(repeats, 5), context=short,
        device=next(draft.parameters()).device, own=own)))
    if long <= short:  # a model of few positions: no second context to fit a slope between
        return CostCurve(sizes, time_forwards(target, sizes, repeats, short),
                         time_forwards(draft, sizes, repeats, short, verify=False), unit=TOKENS, context=short,
                         **host)
    t, d = time_forwards(target, sizes, repeats, short), time_forwards(draft, sizes, repeats, short, verify=False)
    tl, dl = time_forwards(target, ks, repeats, long), time_forwards(draft, ks, repeats, long, verify=False)
    far = {}
    if beyond and beyond[0] > long:  # a third context: the slope beyond the second
        tf, df = (time_forwards(m, ks, repeats, beyond[0], verify=v) for m, v in ((target, True), (draft, False)))
        far = {"far_context": long, "target_far_key_ms": per_key(ks, tl, ks, tf, beyond[0] - long),
               "draft_far_key_ms": per_key(ks, dl, ks, df, beyond[0] - long)}
    return CostCurve(sizes, t, d, unit=TOKENS, context=short, key_sizes=ks, **host, **far,
                     target_key_ms=per_key(sizes, t, ks, tl, long - short),
                     draft_key_ms=per_key(sizes, d, ks, dl, long - short))
