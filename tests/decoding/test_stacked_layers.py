"""Every layer of a stacked verify in one kernel call (`decoder_stack_segments`) against the same
forward a layer at a time (`decoder_layer_segments` from Python): the same logits, captured layer
inputs and KV caches, bit for bit, on the fp32 panels and on a GGUF's blocks (AVX512 kernels, and
csrc/quant_layer.cpp as an AVX2-only CPU runs it)."""

from __future__ import annotations

import random

import pytest
import torch

import decoding.batch.forward as batch_forward
from decoding.batch.forward import Segment, verify_many
from decoding.forward import kernels, quant
from decoding.forward.packed import set_forward
from decoding.kv_cache import CachedModel
from decoding.tree import TreeLayout
from support.models import tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the one-call layers need decoding.forward.kernels")


def _round(rng: random.Random, n: int) -> TreeLayout:
    """A random tree of n nodes numbered breadth-first: sorted parents keep depth order, and the
    i-th smallest of parents each below its own index stays below i."""
    return TreeLayout(tuple(sorted(rng.choice([-1, *range(i)]) for i in range(n))))


def _rounds(model, stacked: bool, monkeypatch) -> list[torch.Tensor]:
    """Three requests, four rounds (prompts, random trees, random accepted paths), layers 0 and 2's
    inputs captured: every logit, capture and cached key / value."""
    calls = []
    real = batch_forward._one_call_stack

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(batch_forward, "_one_call_stack", spy)
    if not stacked:
        monkeypatch.setattr(batch_forward, "_stack", lambda model: None)
    rng = random.Random(0)
    texts = [[1, 5, 7, 3], [2], [9, 9, 9, 4, 4, 4, 11, 30, 17]]
    caches = [CachedModel(model) for _ in texts]
    out = []
    for _ in range(4):
        lays = [_round(rng, rng.randint(0, 5)) for _ in texts]
        toks = [[rng.randrange(32) for _ in range(lay.size)] for lay in lays]
        segs = [Segment(c, list(t), lay, tk, capture=(0, 2)) for c, t, lay, tk in zip(caches, texts, lays, toks)]
        out += verify_many(model, segs) + [s.captured for s in segs]
        for c, t, lay, tk in zip(caches, texts, lays, toks):
            path = lay.path_to(rng.randrange(lay.size)) if lay.size else []
            c.commit(path, lay.size)
            t += [tk[i] for i in path] + [rng.randrange(32)]
    out += [x for c in caches for layer in c.cache.layers for x in (layer.keys, layer.values)]
    monkeypatch.undo()
    assert bool(calls) == stacked  # the path under test ran (or did not)
    return out


@pytest.mark.parametrize("blocks", [None, "avx512", "avx2"])
def test_one_call_for_all_layers_equals_a_call_a_layer(blocks, monkeypatch):
    runs = []
    for stacked in (True, False):
        m = tiny_llama(0, vocab=32, layers=4, hidden=32, scale=6)
        if blocks:
            quant.quantize_model(m, "Q4_1")
        set_forward(m, "lean", kernels=blocks != "avx2")
        assert all(layer._lean["one_call"] > 1 for layer in m.model.layers)
        runs.append(_rounds(m, stacked, monkeypatch))
    a, b = runs
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("draft", ["none", "head"])
def test_the_batch1_engine_verifies_through_the_stack(draft, monkeypatch):
    """decoding.engine's verify goes through the whole-stack call (feed_one) and gives what
    transformers' model forward gives: the same tokens and, with a feature head reading the
    target's layer inputs (published as taps, no hooks run), the same accepted lengths."""
    from support.head import fit_head

    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(target) if draft == "head" else None
    set_forward(target, "lean")
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=4) if head else StrategyConfig(strategy="ar")
    runs = []
    for stacked in (True, False):
        calls = []
        real = batch_forward._one_call_stack
        monkeypatch.setattr(batch_forward, "_one_call_stack", lambda *a, c=calls, f=real: c.append(1) or f(*a))
        if not stacked:
            monkeypatch.setattr(batch_forward, "_stack", lambda model: None)
        eng = build_engine(target, head, cfg, SamplingConfig(temperature=0.0))
        runs.append([eng.generate(p, 24) for p in ([1, 5, 7], [9, 9, 4, 4, 11, 30, 17])])
        monkeypatch.undo()
        assert bool(calls) == stacked
    (a, b) = runs
    for (out_a, st_a), (out_b, st_b) in zip(a, b):
        assert out_a == out_b
        assert st_a.accepted_lengths == st_b.accepted_lengths
        if head is not None:
            assert st_a.accepted > 0
