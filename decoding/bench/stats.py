"""Speedup statistics of the benchmark: one row's tokens/s over another's, paired by repeat,
and its confidence interval by a bootstrap over prompts.

Inputs are per-repeat, per-prompt matrices ([repeat][prompt]) of new tokens and wall seconds.
A row's tokens/s in a repeat is its summed tokens over its summed wall time (long prompts
weigh more, as in a throughput figure); the speedup is the median over repeats of the ratio
of two rows' tokens/s in the SAME repeat (repeats interleave all rows, so background load
hits both alike). The interval resamples PROMPTS (the unit the result should generalise
over) with replacement, the same draw for both rows and every repeat, and recomputes that
statistic; repeats are kept as measured.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def _as(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"expected a non-empty [repeat][prompt] matrix, got shape {a.shape}")
    return a


def _stat(a_tok, a_wall, b_tok, b_wall, w: np.ndarray) -> np.ndarray:
    """Speedup for each weight vector (rows of w: how often each prompt is drawn)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (a_tok @ w.T / (a_wall @ w.T)) / (b_tok @ w.T / (b_wall @ w.T))  # [repeat, draw]
    ratio[~np.isfinite(ratio)] = np.nan
    return np.nanmedian(ratio, axis=0) if np.isfinite(ratio).any() else np.full(w.shape[0], np.nan)


def paired_speedup(a_tok, a_wall, b_tok, b_wall) -> float:
    """Median over repeats of (a's tokens/s) / (b's tokens/s), all prompts."""
    a_tok, a_wall, b_tok, b_wall = map(_as, (a_tok, a_wall, b_tok, b_wall))
    return float(_stat(a_tok, a_wall, b_tok, b_wall, np.ones((1, a_tok.shape[1])))[0])


def resample_weights(n: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, n]: how often each of n items (prompts) is drawn in each bootstrap resample;
    a statistic of sums over items is then `weights @ per_item_values`."""
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    w = np.zeros((resamples, n))
    np.add.at(w, (np.repeat(np.arange(resamples), n), draws.ravel()), 1.0)
    return w


def speedup_ci(a_tok, a_wall, b_tok, b_wall, resamples: int = RESAMPLES, level: float = LEVEL,
               seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high): the paired speedup and its percentile-bootstrap interval over
    prompts. The interval is widened to contain the point estimate where a skewed resampling
    distribution would leave it outside (conservative: never narrower than the percentiles)."""
    a_tok, a_wall, b_tok, b_wall = map(_as, (a_tok, a_wall, b_tok, b_wall))
    if not a_tok.shape == a_wall.shape == b_tok.shape == b_wall.shape:
        raise ValueError("the two rows must be measured on the same repeats and prompts")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError("resamples must be >= 1 and level in (0, 1)")
    point = paired_speedup(a_tok, a_wall, b_tok, b_wall)
    vals = _stat(a_tok, a_wall, b_tok, b_wall, resample_weights(a_tok.shape[1], resamples, seed))
    vals = vals[np.isfinite(vals)]
    if not np.isfinite(point) or vals.size == 0:
        return point, float("nan"), float("nan")
    lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
    return point, float(min(lo, point)), float(max(hi, point))
