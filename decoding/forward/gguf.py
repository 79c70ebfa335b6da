"""A target converted from a GGUF multiplies by the file's own blocks (decoding.forward.quant)
where the kernel takes their type: in float32 on a CPU with the kernel built."""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

import torch

from decoding.forward import gguf_reader, quant
from decoding.models.named_targets import NAMED, cache_root
from decoding.models.resolve import from_gguf, gguf_source, resolve_model_dir


def runs_quantized(target: str | os.PathLike | None, device: str = "cpu") -> bool:
    """The target is a GGUF whose linears run on their blocks here (float32, a CPU with the
    quantized kernel built): `dtype: auto` and the defaults then load it in float32."""
    return str(device).startswith("cpu") and from_gguf(target) and quant.available()


def attach(model, target: str | os.PathLike | None) -> int:
    """Multiply `model` (loaded from `target`) by its GGUF's blocks where it came from one and
    runs in float32 on a CPU; returns how many linears do (0: the dequantized linears, e.g.
    bf16, $SPECSTOP_QUANT=0)."""
    if not from_gguf(target) or model.dtype != torch.float32 or model.device.type != "cpu" or not quant.available():
        return 0
    src = gguf_source(target)
    if src is None:  # a named target: its GGUF lives in its packages
        return quant.attach(model, named_blocks(str(target), model.config))
    return quant.attach(model, gguf_reader.load_blocks(src, model.config, resolve_model_dir(target)))


def named_blocks(name: str, config) -> dict:
    """A named target's GGUF blocks, kept beside its converted weights;
    the first call assembles the GGUF again for them (sha256-checked, ~250 MB, deleted after).
    Once kept they serve without the packages, as the converted weights do (attach checks them
    against those); empty (the dequantized linears) when neither is there."""
    import warnings
    from importlib.metadata import PackageNotFoundError, version

    module, package = NAMED[name]
    out = cache_root() / name

    def read() -> dict:
        mod = importlib.import_module(module)
        mod.verify_chunks()
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as tmp:
            return gguf_reader.read_gguf(mod.assemble(output_path=Path(tmp) / mod.MODEL_NAME), config)

    try:
        stamp = f"{package}=={version(package)}"
    except PackageNotFoundError:
        stamp = gguf_reader.kept_stamp(out) or ""
    try:
        if not stamp.startswith(f"{package}=="):
            raise PackageNotFoundError(package)
        return gguf_reader.kept_blocks(read, stamp, out)
    except (ImportError, OSError, PackageNotFoundError) as e:
        warnings.warn(f"{name}: its GGUF packages are gone ({type(e).__name__}), so it runs dequantized", stacklevel=2)
        return {}
