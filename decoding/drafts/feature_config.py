"""The EAGLE-3 feature head's shapes (decoding.drafts.feature): FeatureDraftConfig, read from a
target's config (its widths, heads, vocabulary, RoPE base, the three layers whose input residual
stream the head fuses) and stored beside the head's weights (to_dict / from_dict)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high layers (EAGLE-3's defaults): 2, L // 2, L - 3 (30 layers: 2, 15, 27)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def target_rope_theta(tcfg) -> float:
    """The target's RoPE base (per layer type, Gemma 3: the global one: the head sees all)."""
    params = getattr(tcfg, "rope_parameters", None) or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(tcfg, "rope_theta", None) or 10000.0))


@dataclass
class FeatureDraftConfig:
    fingerprint_architecture = "eagle3"  # a class attribute, not a field (decoding.models.fingerprint)
    hidden_size: int = 576
    """Width of the draft layer (= the target's embedding width: embeddings are shared)."""
    target_hidden_size: int = 576
    """Width of each captured target state; `fc` takes 3 of them."""
    target_num_layers: int = 30
    """Decoder layers of the target (recorded for checks)."""
    aux_layers: tuple[int, ...] = (2, 15, 27)
    """Target layers whose INPUT residual stream is captured (forward pre-hooks)."""
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    """The target's vocabulary (length of `t2d`)."""
    draft_vocab_size: int = 8192
    """Rows of `lm_head` (the most frequent target ids)."""
    rope_theta: float = 100000.0
    """RoPE base actually used (must match what serving engines are told)."""
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    embed_scale: float = 1.0
    """The target's embedding function is embedding(ids) * embed_scale (Gemma: sqrt(hidden);
    measured by decoding.models.target_layout)."""
    extra: dict = field(default_factory=dict)
    """Free-form provenance (training run, data); not read by the model."""

    def __post_init__(self):
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers (got {self.aux_layers})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size} (got {self.draft_vocab_size})")

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int = 8192, aux_layers=None,
                    embed_scale: float = 1.0) -> FeatureDraftConfig:
        """Shapes from the target's config (GPT-NeoX names some fields differently)."""
        n, hidden, heads = tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.num_attention_heads
        eps = next((getattr(tcfg, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                    if getattr(tcfg, k, None) is not None), 1e-6)
        return cls(
            hidden_size=hidden, target_hidden_size=hidden, target_num_layers=n,
            aux_layers=tuple(aux_layers) if aux_layers else default_aux_layers(n),
            num_attention_heads=heads, num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or hidden // heads,
            intermediate_size=getattr(tcfg, "intermediate_size", None) or 4 * hidden, vocab_size=tcfg.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tcfg.vocab_size), rope_theta=target_rope_theta(tcfg),
            rms_norm_eps=eps, max_position_embeddings=tcfg.max_position_embeddings,
            embed_scale=float(embed_scale),
        )

    @classmethod
    def for_target(cls, target, draft_vocab_size: int = 8192, aux_layers=None) -> FeatureDraftConfig:
        """from_target + the loaded target's measured embedding scale (ModelError: a layout no
        head can read; decoding.models.target_layout)."""
        from decoding.models.target_layout import target_layout

        return cls.from_target(target.config, draft_vocab_size, aux_layers, target_layout(target).embed_scale)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FeatureDraftConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown feature-draft config keys: {', '.join(sorted(unknown))}")
        return cls(**d)
