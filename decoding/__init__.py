"""specstop decoding. `Decoder` and `GenerationResult` (decoding.api) are imported on first
use, so `import decoding` stays light (no torch / transformers until then)."""

from decoding.forward import cpu as _cpu  # noqa: F401  before torch: $SPECSTOP_CPU holds it to AVX2

__all__ = ["Decoder", "GenerationResult"]


def __getattr__(name):
    if name in __all__:
        from decoding import api

        return getattr(api, name)
    raise AttributeError(f"module 'decoding' has no attribute {name!r}")
