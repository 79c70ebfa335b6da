"""A GGUF target at its own precision: the linears keep their quantized blocks and multiply by them.

A CPU user's target is a GGUF of 4.5 bits a weight (SmolLM2-135M-Instruct Q4_1: 98 MB). The
dequantized fp32 model streams ~540 MB a step; the kernels here stream the blocks (re-laid once
into panels of 16 outputs). Blocks: Q4_0, Q4_1 and Q8_0 as they are (the embedded target's linears
are Q4_1, its tied embedding / output layer Q8_0); Q5_0, Q4_K and Q6_K (a Q4_K_M file's) re-laid
once into blocks of 32 with the same weights (decoding.forward.kquants). Another type keeps the
dequantized fp32 linear. A GGUF's blocks are read (and kept beside the converted target) by
decoding.forward.gguf_reader.

What is quantized ($SPECSTOP_QUANT_ACT, ACT_ENV below):
- q8 (default): the activations too, int8 per block of 32 as llama.cpp's dot products do, with
  exact integer block sums (csrc/quant_q8.cpp);
- f32: the weights only; every dequantized weight is exactly the dequantized model's number
  (q * d is exact in fp32), so the result differs from it only in summation order (csrc/quant.cpp).
Either way the quantized path is a forward of its own on which greedy equality and exact sampling
are proven, and a row of a verify equals a 1-token step bit for bit (tests/forward/test_quantized_blocks.py).

Built on first use (~20 s, cached like decoding.forward.kernels) on any x86-64 CPU with AVX2, FMA and
F16C; AVX512 (with VNNI) where the CPU has it. $SPECSTOP_QUANT_ISA=avx2 forces the AVX2 path on an
AVX512 CPU (so one machine checks both); $SPECSTOP_QUANT=0 keeps the dequantized fp32 linears.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from decoding.forward import cpu, kquants

ENV = "SPECSTOP_QUANT"
"""0: a GGUF target runs its dequantized fp32 linears (the reference) instead of its blocks."""
ISA_ENV = "SPECSTOP_QUANT_ISA"
"""auto (default: AVX512 where the CPU has it), avx2 or avx512."""
ISAS = {"auto": 0, "avx2": 1, "avx512": 2}
KINDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": kquants.KQ4, "Q6_K": kquants.KQ6}
"""ggml block types the kernel multiplies by, to their ggml ids (Q4_K / Q6_K re-laid; a Q5_0
tensor becomes Q8_0 blocks)."""
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, kquants.KQ4: kquants.KQ4_BYTES, kquants.KQ6: kquants.KQ6_BYTES}
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("quant*.cpp"))
ops = torch.ops.specstop_quant
"""The quantized library's ops (its own namespace): reached here, after `available()` loaded them."""
ACT_ENV = "SPECSTOP_QUANT_ACT"
"""How a quantized linear takes its activations: q8 (int8 per block of 32, as llama.cpp's dot
products; csrc/quant_q8.cpp) or f32 (float32: the dequantized model's numbers up to summation
order; csrc/quant.cpp). Default: q8, unless $SPECSTOP_BATCH_INVARIANT=0 (torch's attention): rounding
x to 8 bits turns a last-bit difference between a verify row and a step into a whole quantum about
once a token, enough to flip greedy near-ties, so q8 needs the batch-invariant attention
(decoding.forward.kernels's, or `row_attention` here where that does not build)."""
ACTS = ("q8", "f32")
_state: dict = {}


def _load() -> str | None:
    if os.environ.get(ENV, "").strip() == "0":
        return f"${ENV}=0"
    cpu.warn_torch_isa()
    if hasattr(ops, "linear"):
        return None
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernel for {platform.machine()}"
    try:
        _build()
    except Exception as e:  # no compiler, an old CPU: the dequantized linears still work
        lines = str(e).splitlines() or [""]
        first = next((ln for ln in lines if "error:" in ln), lines[-1])[:200]  # the compiler's, if any
        why = f"the quantized kernel is unavailable ({type(e).__name__}: {first})"
        warnings.warn(f"decoding.forward.quant: {why}; GGUF targets run dequantized", stacklevel=3)
        return why
    return None


def _build() -> None:
    """Build and load the library, and check the CPU has what the asked path needs (raises)."""
    from torch.utils.cpp_extension import load

    from decoding.forward.kernels import stable_sources

    name = f"specstop_quant_{revision()}"
    load(name, stable_sources(name, SOURCES), extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
    ops.isa(_isa_arg())


def _isa_arg() -> int:
    asked = os.environ.get(ISA_ENV, "auto").strip() or "auto"
    if asked not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)} (got {asked!r})")
    if asked == "auto" and cpu.emulated() == "avx2":  # an AVX2-only CPU, acted on a bigger one
        return ISAS["avx2"]
    return ISAS[asked]


def why_not() -> str | None:
    """None when the quantized kernel runs in this process, else one phrase why not."""
    if "why" not in _state:
        _state["why"] = _load()
    return _state["why"]


def available() -> bool:
    return not _state.get("off") and why_not() is None


@contextlib.contextmanager
def dequantized():
    """GGUF targets loaded inside run their dequantized fp32 linears (as $SPECSTOP_QUANT=0, which
    a process reads once): the reference a check against an engine on those weights needs."""
    _state["off"] = _state.get("off", 0) + 1
    try:
        yield
    finally:
        _state["off"] -= 1


CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
"""-fopenmp: without it at::parallel_for compiles to a serial loop (until 2026-11-27 a second thread
did nothing in these kernels)."""


def revision() -> str:
    """The kernel's source and flags hash: a cost curve timed on another kernel is a miss
    (decoding.forward.cost_cache)."""
    files = [*SOURCES, *(CSRC / h for h in ("quant.h", "quant_q8_kernels.h", "segments.h", "attention_mask.h"))]  # torch's loader rebuilds on a changed source, not a header
    return hashlib.sha256(b"".join(p.read_bytes() for p in files) + " ".join(CFLAGS).encode()).hexdigest()[:12]


def act() -> str:
    """How quantized linears take their activations here ($SPECSTOP_QUANT_ACT: q8 or f32)."""
    from decoding.forward import kernels

    invariant = os.environ.get(kernels.INVARIANT_ENV, "").strip() != "0"
    asked = os.environ.get(ACT_ENV, "").strip() or ("q8" if invariant else "f32")
    if asked not in ACTS:
        raise ValueError(f"{ACT_ENV} must be one of {', '.join(ACTS)} (got {asked!r})")
    return asked


def act_of(model: torch.nn.Module) -> str | None:
    """How `model`'s quantized linears take their activations as it runs now (the lean forward:
    act(); the packed one: f32 unless asked), None when none runs on blocks."""
    few = getattr(model.get_output_embeddings(), "_few", None)
    if isinstance(few, QuantWeight):
        return few.act
    mods = [m for m in model.modules() if isinstance(getattr(m, "_quant", None), QuantWeight)]
    return mods[0]._quant.act if mods else None


def isa() -> str:
    """The instruction set the kernel runs on here: avx2 or avx512 ('' when unavailable)."""
    if not available():
        return ""
    return {1: "avx2", 2: "avx512"}[ops.isa(_isa_arg())]


class QuantWeight:
    """A weight [N, K] as ggml blocks (uint8 [N, K / 32 * block bytes]); called like
    decoding.forward.kernels.FewRowWeight: x [T, K] float32 -> x @ w.T + bias, any T."""

    op = None  # not a packed float weight: kernels.gather leaves it where it is

    def __init__(self, blocks: torch.Tensor, kind: int, k: int):
        if kind not in BLOCK_BYTES or k % 32 or blocks.shape[1] != k // 32 * BLOCK_BYTES[kind]:
            raise ValueError(f"QuantWeight: {tuple(blocks.shape)} is not {k} columns of ggml type {kind}")
        self.w, self.kind, self.k, self.n = blocks.contiguous(), kind, k, blocks.shape[0]
        self.isa, self.act, self.panels = _isa_arg(), act(), None
        why_not()  # the ops are registered on first use

    def for_torch_attention(self) -> QuantWeight:
        """This weight for a model whose layers attend with torch's attention (the packed forward,
        not batch-invariant): f32 activations unless $SPECSTOP_QUANT_ACT asks otherwise (see ACT_ENV)."""
        if self.act != "q8" or os.environ.get(ACT_ENV, "").strip():
            return self
        w = QuantWeight(self.w, self.kind, self.k)
        w.act = "f32"
        return w

    def packed(self) -> torch.Tensor:
        """The kernel's layout of the blocks (csrc/quant*.cpp), made on first use."""
        if self.panels is None:
            self.panels = (ops.pack_q8 if self.act == "q8" else ops.pack)(self.w, self.kind, self.k)
        return self.panels

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        op = ops.linear_q8 if self.act == "q8" else ops.linear
        return op(x.float(), self.packed(), self.kind, self.k, bias, self.isa)

    def dequant(self) -> torch.Tensor:
        """float32 [N, K]: exactly the weights the kernel multiplies by."""
        return ops.dequant(self.w, self.kind, self.k)

    @staticmethod
    def cat(ws: list[QuantWeight]) -> QuantWeight | None:
        """Weights sharing an input as one (their outputs concatenated); None unless one type."""
        if len({(w.kind, w.k) for w in ws}) != 1:
            return None
        return QuantWeight(torch.cat([w.w for w in ws]), ws[0].kind, ws[0].k)


def row_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """Batch-invariant float32 attention for the lean layers where decoding.forward.kernels does not
    build (csrc/quant_attention.cpp; the contract of specstop::row_attention): [B, T, H, D]."""
    return ops.row_attention(q, k, v, mask, scale)


def attends_here(dtype: torch.dtype) -> bool:
    """A GGUF target's lean layers that do not run on decoding.forward.kernels (not built here, or
    set_forward(kernels=False)) attend with `row_attention` above: float32, the kernel built,
    $SPECSTOP_BATCH_INVARIANT not 0."""
    from decoding.forward import kernels

    return dtype == torch.float32 and available() and os.environ.get(kernels.INVARIANT_ENV, "").strip() != "0"


def runs_on_kernel(w: QuantWeight | None) -> bool:
    """The kernel takes this weight (its outputs fill panels of 16)."""
    return w is not None and w.n % 16 == 0 and available()


@torch.no_grad()
def attach(model: torch.nn.Module, weights: dict[str, QuantWeight]) -> int:
    """Give each nn.Linear of `model` whose weight is in `weights` its blocks (`_quant`); the
    lean and packed forwards (decoding.forward.packed) then multiply by them. The dense weight is
    replaced by the blocks' exact dequantization (the reference the quantized path equals up to
    summation order), after checking it is the same matrix (a GGUF for another model is refused).
    A tied output layer takes the embedding's blocks. Returns how many linears got blocks."""
    from decoding.models.errors import ModelError

    if model.dtype != torch.float32 or not available():
        return 0
    params = dict(model.named_parameters(remove_duplicate=False))
    head = model.get_output_embeddings()
    n = 0
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear:
            continue
        key = f"{name}.weight"
        qw = weights.get(key)
        if qw is None and mod is head and mod.weight is params.get("model.embed_tokens.weight"):
            qw = weights.get("model.embed_tokens.weight")
        if qw is None or not runs_on_kernel(qw):
            continue
        rows = slice(None, None, 61)  # a sample: a wrong file or a wrong row order shows at once
        sample = QuantWeight(qw.w[rows], qw.kind, qw.k).dequant()
        if (qw.n, qw.k) != tuple(mod.weight.shape) or not torch.allclose(sample, mod.weight[rows], atol=1e-2, rtol=0):
            raise ModelError(f"the GGUF's {key} is not this model's (shape {(qw.n, qw.k)} vs "
                             f"{tuple(mod.weight.shape)}, or other values)")
        if not torch.equal(sample, mod.weight[rows]):  # transformers' fp32 dequantization is exact: rarely
            mod.weight.copy_(qw.dequant())
        mod._quant = qw
        n += 1
    model._specstop_quant = n
    return n


HEAD_KIND = "Q8_0"
"""The block type a feature head beside a GGUF target is quantized to (`quantize_head`)."""


@torch.no_grad()
def quantize_head(draft: torch.nn.Module, kind: str = HEAD_KIND) -> int:
    """A feature head drafting for a GGUF target runs on blocks too (its fc, its layer's linears,
    its output layer, as `kind`): beside a target step of ~5 ms its fp32 step (~1.3 ms on a 2-core
    AVX512 EPYC) was a quarter of a round. The head's dense weights become the blocks' values, so
    its eager forward is the same head; its fingerprint stays the checkpoint's (a decider fitted
    for the pair still loads). Lossless either way: the draft only proposes. Returns how many."""
    if draft.fc.weight.dtype != torch.float32 or draft.fc.weight.device.type != "cpu" or not available():
        return 0
    from decoding.models.fingerprint import weights_sample_sha256

    draft._loaded_weights_sha256 = weights_sample_sha256(draft)
    n = 0
    for mod in draft.modules():
        w = getattr(mod, "weight", None)
        if type(mod) is torch.nn.Linear and w.shape[1] % 32 == 0 and w.shape[0] % 16 == 0:
            mod._quant = quantize(w, kind)
            w.copy_(mod._quant.dequant())
            n += 1
    draft._specstop_quant = n
    return n


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """A float weight [N, K] quantized to `kind` blocks by the gguf package, or decoding.forward.kquants
    for the K-quants (tests, small models); Q5_0 gives its Q8_0 blocks, as a GGUF's is read."""
    blocks, kid = kquants.quantize_raw(w.detach().float().numpy(), kind), KINDS.get(kind)
    if kind in kquants.RELAID:
        blocks, kid = kquants.relay(blocks, kind, w.shape[1])
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), kid, w.shape[1])


def quantize_model(model: torch.nn.Module, kind: str = "Q4_1") -> int:
    """Quantize every linear of a float32 model whose shape allows it (K % 32, N % 16), as a GGUF
    of that type would hold it, and attach the blocks (tests and small models). A K-quant takes
    the linears of whole super-blocks (K % 256) and Q5_0 the others, as llama.cpp's quantizer does."""
    weights = {f"{name}.weight": quantize(mod.weight, kquants.fitting(kind, mod.weight.shape[1]))
               for name, mod in model.named_modules()
               if type(mod) is torch.nn.Linear and mod.weight.shape[1] % 32 == 0 and mod.weight.shape[0] % 16 == 0}
    with torch.no_grad():  # the dense weights become the blocks' values first (attach checks them)
        for name, mod in model.named_modules():
            if f"{name}.weight" in weights:
                mod.weight.copy_(weights[f"{name}.weight"].dequant())
    return attach(model, weights)


def quantized(model: torch.nn.Module) -> int:
    """How many linears of `model` multiply by their blocks."""
    return getattr(model, "_specstop_quant", 0)
