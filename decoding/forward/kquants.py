"""GGUF block types the kernels read through a re-layout: Q5_0 and the K-quants Q4_K and Q6_K.

The kernels (csrc/quant*.cpp) work on blocks of 32 weights. A GGUF's other common types become
such blocks once, at load, without changing a single weight (each re-laid block dequantizes to
exactly the float gguf's own dequantizer gives; tests/forward/test_quantized_blocks.py checks it
bit for bit):
- Q5_0 (d fp16, q 0..31, w = d (q - 16)) is a Q8_0 block (d fp16, int8 q - 16): 34 bytes for 22;
- Q4_K (super-blocks of 256: fp16 d, dmin and 6-bit scale / min per 32, 4-bit q; w = d sc q - dmin m)
  becomes KQ4: per 32, fp32 d sc and -dmin m (exact in fp32: 11 + 6 bits) and the 16 nibble bytes;
- Q6_K (super-blocks of 256: fp16 d, int8 scale per 16, 6-bit q; w = d sc (q - 32)) becomes KQ6:
  per 32, the two fp32 scales of its halves (exact: 11 + 8 bits) and 32 int8 q - 32.
The re-laid blocks take more room than the file's (KQ4 6 bits a weight for 4.5, KQ6 10 for 6.6),
still a fifth to a third of fp32. Super-blocks need K % 256 == 0: llama.cpp's quantizer itself falls
back to Q5_0 / Q8_0 for the other tensors (a K = 576 or 640 input).

`quantize_q4_k` / `quantize_q6_k` make valid super-blocks from floats (round to nearest, no search
as llama.cpp's quantizer does): for tests and small models, since the gguf package has none.
"""

from __future__ import annotations

import numpy as np

KQ4, KQ6 = 12, 14
"""The kernels' ids of the re-laid Q4_K and Q6_K blocks (ggml's ids of those types)."""
KQ4_BYTES, KQ6_BYTES = 24, 40
SUPER = 256
RELAID = ("Q5_0", "Q4_K", "Q6_K")
"""GGUF types read through a re-layout (the kernels take Q4_0, Q4_1 and Q8_0 as they are)."""


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def relay(raw: np.ndarray, kind: str, k: int) -> tuple[np.ndarray, int]:
    """A GGUF tensor's blocks uint8 [N, bytes] of `kind` (RELAID) -> (blocks of 32 [N, K / 32 *
    block bytes], the kernels' kind id)."""
    n = raw.shape[0]
    if kind == "Q5_0":
        b = raw.reshape(n * k // 32, 22)
        qh = b[:, 2:6].copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
        ql = b[:, 6:22].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        q = ((ql & 15).reshape(-1, 32) | ((qh & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return np.concatenate([b[:, :2], q.view(np.uint8)], axis=1).reshape(n, -1), 8
    if k % SUPER:
        raise ValueError(f"{kind}: {k} columns are not whole super-blocks of {SUPER}")
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        b = raw.reshape(n * k // SUPER, 144)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        d = (_f16(b[:, 0:2]) * sc.astype(np.float32)).reshape(-1, 1)
        m = -(_f16(b[:, 2:4]) * mn.astype(np.float32)).reshape(-1, 1)
        # super-block quants: byte 32c + l holds weight 64c + l (low) and 64c + 32 + l (high);
        # a KQ4 block of 32 keeps Q4_1's order: byte i holds weight i (low) and i + 16 (high)
        q = (b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        q = q.reshape(-1, 32)
        qs = q[:, :16] | (q[:, 16:] << 4)
        return np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=1).reshape(n, -1), KQ4
    if kind == "Q6_K":
        b = raw.reshape(n * k // SUPER, 210)
        ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        d = (_f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1, 2)
        return np.concatenate([d.view(np.uint8), q.reshape(-1, 32).view(np.uint8)], axis=1).reshape(n, -1), KQ6
    raise ValueError(f"no re-layout for GGUF type {kind}")


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] -> Q4_K super-blocks uint8 [N, K / 256 * 144]."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    off = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((x + off) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs],
                          axis=1).reshape(n, k // SUPER * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] -> Q6_K super-blocks uint8 [N, K / 256 * 210]."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(x / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                           d.reshape(-1, 1).view(np.uint8)], axis=1).reshape(n, k // SUPER * 210)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def fitting(kind: str, k: int) -> str:
    """The type a K-column tensor of `kind` gets: a K-quant falls back to Q5_0 off whole
    super-blocks, as llama.cpp's quantizer does."""
    return "Q5_0" if kind in QUANTIZERS and k % SUPER else kind


def quantize_raw(w: np.ndarray, kind: str) -> np.ndarray:
    """float [N, K] -> the GGUF blocks of `kind` as a file holds them (gguf's quantizer, ours for
    the K-quants)."""
    if kind in QUANTIZERS:
        return QUANTIZERS[kind](w)
    from gguf import GGMLQuantizationType, quantize

    return quantize(w.astype(np.float32), GGMLQuantizationType[kind])
