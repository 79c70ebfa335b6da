"""The int8 quantization of activations (csrc/quant_q8.cpp, $SPECSTOP_QUANT_ACT=q8) is the rule
its scalar loop states, exactly: per block of 32, dx = max|x| / 127 and inv = 1 / dx in float32,
q = x * inv in float32 rounded to nearest with ties to EVEN, clamped to +-127. Ties to even is what
llama.cpp's x86 path does (_mm256_round_ps, _MM_ROUND_NEAREST); its scalar reference
quantize_row_q8_0_ref rounds ties away from zero (roundf), which this input tells apart.

The kernel does not expose q: a weight that is a scaled identity (one weight per output, every
other exactly 0, for every block type) reads each q back as y / (dx w) to far under half a unit."""

import numpy as np
import pytest
import torch

from decoding.forward import cpu, quant
from support.kernels import require_quant

KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
ISAS = [1, 2] if "avx512_vnni" in cpu.flags() else [1]
K = 256  # one K-quant super-block, 8 blocks of 32


def rows(t: int) -> np.ndarray:
    """t rows of 8 blocks: exact halves at scales 1, 1/4 and 3, halves of an inexact scale, a zero
    block, and random ones; odd rows negated (ties below zero)."""
    g = np.random.default_rng(0)
    k = np.arange(31, dtype=np.float32)
    halves = np.where(k % 2 == 0, 1, -1).astype(np.float32) * (3 * k + 0.5)  # +-0.5 .. +-90.5
    out = []
    for i in range(t):
        g.shuffle(halves)
        blocks = [np.append(halves, 127), np.append(halves / 4, 31.75), np.append(halves * 3, 381),
                  np.append(halves * np.float32(1 / 127), 1), np.zeros(32)]
        blocks += [g.standard_normal(32) * s for s in (0.01, 1, 50)]
        out.append(np.concatenate(blocks).astype(np.float32) * (-1 if i % 2 else 1))
    return np.stack(out)


def rule(x: np.ndarray, ties_away: bool = False):
    """(q, dx, x * inv) per element as the scalar loop computes them, every step in float32."""
    xb = x.reshape(x.shape[0], -1, 32)
    dx = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, np.float32(1)), np.float32(0))
    r = xb * inv
    q = np.trunc(r + np.copysign(np.float32(0.5), r)) if ties_away else np.rint(r)
    return np.clip(q, -127, 127).reshape(x.shape), np.repeat(dx, 32, -1).reshape(x.shape), r.reshape(x.shape)


def test_input_is_mostly_ties_the_two_rules_round_apart():
    x = rows(4)
    q, _, r = rule(x)
    ties = (r - np.floor(r)) == 0.5
    assert ties.sum() >= 4 * 3 * 31 and (ties & (x < 0)).sum() >= 4 * 31  # both signs
    assert (q != rule(x, ties_away=True)[0]).sum() >= 4 * 40


@pytest.mark.parametrize("t", [1, 5])  # a step, a verify's rows
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_quantization_is_the_stated_rule_ties_included(kind, isa, t):
    require_quant()
    w = quant.quantize(torch.eye(K) * 0.75, kind)  # 0.75: a diagonal no block type keeps exactly
    w.act, w.isa = "q8", isa
    diag = w.dequant().diagonal().double()
    assert (w.dequant() - torch.diag(w.dequant().diagonal())).abs().max() == 0 and diag.min() > 0.5
    x = rows(t)
    q, dx, _ = rule(x)
    y = w(torch.from_numpy(x)).double()
    scale = torch.from_numpy(dx).double() * diag
    got = torch.where(scale > 0, y / scale.clamp_min(1e-30), y)
    assert (got - got.round()).abs().max() < 0.01  # read back to far under half a unit
    assert torch.equal(got.round(), torch.from_numpy(q).double())
