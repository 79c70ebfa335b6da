"""A GGUF target at its own precision: the linears keep their quantized blocks and multiply by them.

A CPU user's target is a GGUF of 4.5 bits a weight (SmolLM2-135M-Instruct Q4_1: 98 MB). The
dequantized fp32 model streams ~540 MB a step; the kernels here stream the blocks (re-laid once
into panels of 16 outputs). Blocks: Q4_0, Q4_1 and Q8_0 as they are (the embedded target's linears
are Q4_1, its tied embedding / output layer Q8_0); Q5_0, Q4_K and Q6_K (a Q4_K_M file's) re-laid
once into blocks of 32 with the same weights (decoding.forward.kquants). Another type keeps the
dequantized fp32 linear.

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

import hashlib
import json
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
# GGUF tensor names of a Llama-family layer -> the transformers module they belong to
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
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
    return why_not() is None


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


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q / k rows per head; undo it
    (as transformers' GGUF loader does), on whole rows of blocks."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def load_blocks(path: str | os.PathLike, config, cache_dir: Path | None = None) -> dict[str, QuantWeight]:
    """read_gguf, kept once as safetensors in `cache_dir` (the target's converted directory):
    parsing a GGUF (its 49k-token vocabulary) took 2.6 s a load; the kept blocks load in ~0.1 s.
    The file records the GGUF's size and time: another file is read anew (atomic write)."""
    st = Path(path).stat()
    return kept_blocks(lambda: read_gguf(path, config), f"{st.st_size}:{st.st_mtime_ns}", cache_dir)


READER = 2
"""What read_gguf keeps (2: + Q5_0 / Q4_K / Q6_K re-laid): a kept file of another version is read anew."""


def blocks_file(target_dir: Path) -> Path:
    """Where a converted target's blocks are kept: BESIDE its directory, never inside (an engine
    pointed at the directory loads every *.safetensors in it). A file kept inside by an older
    version moves out."""
    target_dir = Path(target_dir)
    out = target_dir.parent / f"{target_dir.name}.gguf_blocks.safetensors"
    old = target_dir / "gguf_blocks.safetensors"
    if old.is_file() and not out.exists():
        os.replace(old, out)
    return out


def kept_stamp(cache_dir: Path) -> str | None:
    """The source stamp of the blocks kept for `cache_dir` by this reader, None when none are."""
    from safetensors import safe_open

    kept = blocks_file(cache_dir)
    try:
        with safe_open(str(kept), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # absent, unreadable (safetensors raises its own error type)
        return None
    return meta.get("source") if meta.get("reader") == str(READER) else None


def kept_blocks(read, stamp: str, cache_dir: Path | None) -> dict[str, QuantWeight]:
    """`read()`'s blocks, kept in `cache_dir` under `stamp` (what identifies their source): a kept
    file of another stamp, unreadable or absent is read anew (atomic write)."""
    from safetensors.torch import load_file, save_file

    kept = blocks_file(cache_dir) if cache_dir is not None else None
    if kept is not None and kept.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(kept), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("source") == stamp and meta.get("reader") == str(READER):
                kinds = json.loads(meta["kinds"])
                return {n: QuantWeight(t, kinds[n][0], kinds[n][1]) for n, t in load_file(str(kept)).items()}
        except Exception:  # unreadable, corrupt (safetensors' own error type) or another version: read the GGUF again
            pass
    out = read()
    if kept is not None:
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
        try:
            save_file({n: w.w for n, w in out.items()}, str(tmp), metadata={
                "source": stamp, "reader": str(READER), "kinds": json.dumps({n: [w.kind, w.k] for n, w in out.items()})})
            os.replace(tmp, kept)
        except OSError:  # a read-only cache: read the GGUF each time
            tmp.unlink(missing_ok=True)
    return out


def read_gguf(path: str | os.PathLike, config) -> dict[str, QuantWeight]:
    """The quantized linears of a Llama-family (or Gemma 3) GGUF, by transformers parameter name
    (weights of an unsupported block type are left out: they stay dequantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else "llama"
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in KINDS and kind not in kquants.RELAID or len(t.shape) != 2:
            continue
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        else:
            continue
        k, rows, kid = int(t.shape[0]), np.asarray(t.data), KINDS.get(kind)
        if kind in kquants.RELAID:
            if kind != "Q5_0" and k % kquants.SUPER:
                continue
            rows, kid = kquants.relay(rows, kind, k)
        if arch == "llama" and parts[-2:-1] == ["attn_q"]:  # only llama's converter permutes them
            rows = _unpermute_rows(rows, heads)
        elif arch == "llama" and parts[-2:-1] == ["attn_k"]:
            rows = _unpermute_rows(rows, kv)
        out[name] = QuantWeight(torch.from_numpy(np.array(rows, copy=True)), kid, k)  # off the mmap
    return out


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
