"""EAGLE-3 feature draft head: one decoder layer that reads the target's own hidden states.

Layout (the weight names vLLM / SGLang load for an EAGLE-3 head): `fc` fuses the target's
residual stream at the INPUT of three layers (3 * target_hidden -> hidden, no bias);
`midlayer` attends over `cat(input_layernorm(embed(token)), hidden_norm(h))` (2H wide q/k/v)
with a residual on h, then the usual SwiGLU MLP; `norm` + `lm_head` over a reduced draft
vocabulary. `d2t[i] = used[i] - i` (int64 offsets) maps draft ids to target ids, `t2d` is
the bool mask of used ids over the target vocabulary. Token embeddings are the target's,
frozen: a non-persistent buffer that shares the target's tensor (never saved, never trained).

Sequence convention (as vLLM's EAGLE-3 proposer): the draft entry at position t pairs the
target's features at t with the token at t + 1 and predicts the token at t + 2; its pre-norm
output `h` is the hidden input of the next draft step (position t + 1).

API for training (h8):
- `with capture_aux(target, cfg.aux_layers) as cap: target(input_ids=ids)` (decoding.drafts.capture); then
  `aux = cap.aux()` is [B, T, 3 * target_hidden] (pre-layer residuals, target dtype).
- `draft.unroll(input_ids, aux, steps, attention_mask=None, skip=0, logits=True) -> list[(logits, h)]`,
  one pair per step j (steps >= 1 cover t >= skip only). input_ids [B, T] is x_0..x_{T-1}, aux [B, T, 3Ht]
  the target's features at the same positions, attention_mask [B, T] (1 = real token; right
  padding). Step j at index t reads token x_{t+1+j} at position t+j, with hidden fc(aux_t)
  (j = 0) or step j-1's h at t; it attends to step 0's entries 0..t and to its own entries
  of steps 1..j at t (training-time test, as EAGLE-3). logits [B, T, N] (draft vocabulary)
  at (t, j) predict x_{t+2+j}: the teacher is the target's distribution at position t+1+j
  restricted to `t2d`. Only indices with t + 1 + j < T (and not padding) are meaningful;
  the caller masks the rest.
- `draft.step(tokens, hidden, positions, cache=None, mask=None)` is the inference forward
  (used by `decoding.drafts.feature_proposer`), with a `DraftKV` cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from decoding.drafts.feature_config import (  # noqa: F401 (re-exported)
    FeatureDraftConfig, default_aux_layers, target_rope_theta,
)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in fp32, as transformers and the serving engines do)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: FeatureDraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        # a plain fp32 attribute, not a buffer: .to(bfloat16) must not round the RoPE frequencies
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))

    def qkv(self, x, positions):
        """x [B, T, 2H], positions [B, T] -> q [B, nH, T, d], k / v [B, nKV, T, d] with RoPE."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        ang = positions.to(x.device).float()[..., None] * self.inv_freq
        emb = torch.cat((ang, ang), dim=-1)[:, None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def expand(self, kv):
        return kv.repeat_interleave(self.c.num_attention_heads // self.c.num_key_value_heads, dim=1)

    def out(self, o):
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: FeatureDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: FeatureDraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def attn_input(self, emb, h):
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)

    def finish(self, h, attn):
        h = h + self.self_attn.out(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftKV:
    """KV cache of the single draft layer: [1, nKV, S, d] keys and values."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def cut_front(self, n: int) -> None:
        """Drop the oldest n entries (a head attending a window)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, n:], self.v[:, :, n:]


class FeatureDraft(nn.Module):
    def __init__(self, config: FeatureDraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("embed_weight", None, persistent=False)
        if embed_weight is not None:
            self.attach_embeddings(embed_weight)

    # identity for models.fingerprint (deciders record the pair they were fitted on)
    def get_output_embeddings(self):
        return self.lm_head

    @property
    def identity_weight(self) -> torch.Tensor:
        """The trained rows that identify this head (its embeddings are the target's)."""
        return self.lm_head.weight

    # -- set-up ---------------------------------------------------------------------------
    def attach_embeddings(self, weight: torch.Tensor) -> None:
        """Use the target's token embeddings (shared, frozen, never saved)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embeddings {tuple(weight.shape)} do not fit this head "
                             f"({self.config.vocab_size} x {self.config.hidden_size})")
        self.embed_weight = weight.detach()

    def set_vocab(self, used_ids) -> None:
        """Draft vocabulary = these target ids (sorted ascending): sets d2t and t2d."""
        used = torch.as_tensor(used_ids, dtype=torch.long).unique(sorted=True)
        if used.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct ids, got {used.numel()}")
        if used[0] < 0 or used[-1] >= self.config.vocab_size:
            raise ValueError("draft vocabulary ids outside the target vocabulary")
        self.d2t.copy_(used - torch.arange(used.numel()))
        self.t2d.zero_()
        self.t2d[used] = True

    @property
    def used_ids(self) -> torch.Tensor:
        """Target id of every draft id: arange + d2t."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_output(self, target, used_ids) -> FeatureDraft:
        """Vocabulary, embeddings, lm_head = the target's output rows at `used_ids` and norm =
        its final norm; fc and the midlayer keep their fresh initialisation."""
        from decoding.models.target_layout import target_layout
        layout = target_layout(target)
        self.set_vocab(used_ids)
        self.attach_embeddings(layout.embed.weight)
        self.lm_head.weight.copy_(layout.lm_head.weight[self.used_ids.cpu()].float())
        self.norm.weight.copy_(layout.norm_weight())
        return self

    @torch.no_grad()
    def init_from_target(self, target, used_ids) -> FeatureDraft:
        """lm_head = the target's output rows at `used_ids`, norm = its final norm, midlayer
        from the target's last layer (q/k/v: the target's weight on both halves of the 2H
        input, halved), fc passes the highest captured layer through (when widths match). A
        target layer without Llama's layout (decoding.models.target_layout: Gemma 2/3, Phi3, Mixtral,
        GPT-NeoX) leaves the midlayer freshly initialised."""
        from decoding.models.target_layout import effective_norm_weight, target_layout

        c = self.config
        self.init_output(target, used_ids)
        layout = target_layout(target)
        if c.target_hidden_size == c.hidden_size:
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * c.hidden_size:].copy_(torch.eye(c.hidden_size))
        if not layout.llama_like_layer(-1):
            return self
        src, m = layout.layers[-1], self.midlayer
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight.float()
            if getattr(m.self_attn, name).weight.shape == (w.shape[0], 2 * w.shape[1]):
                getattr(m.self_attn, name).weight.copy_(torch.cat((w, w), dim=1) / 2)
        pairs = [(m.self_attn.o_proj, src.self_attn.o_proj.weight), (m.mlp.gate_proj, src.mlp.gate_proj.weight),
                 (m.mlp.up_proj, src.mlp.up_proj.weight), (m.mlp.down_proj, src.mlp.down_proj.weight),
                 (m.input_layernorm, effective_norm_weight(src.input_layernorm)),
                 (m.hidden_norm, effective_norm_weight(src.input_layernorm)),
                 (m.post_attention_layernorm, effective_norm_weight(src.post_attention_layernorm))]
        for dst, w in pairs:
            if dst.weight.shape == w.shape:
                dst.weight.copy_(w.float())
        return self

    # -- forward --------------------------------------------------------------------------
    def embed(self, tokens):
        if self.embed_weight is None:
            raise RuntimeError("feature draft has no token embeddings: call attach_embeddings(target's)")
        e = nn.functional.embedding(tokens, self.embed_weight)
        if self.config.embed_scale != 1.0:  # in the embedding's dtype, as the target does
            e = e * torch.tensor(self.config.embed_scale, dtype=e.dtype)
        return e.to(self.fc.weight.dtype)

    def fuse(self, aux):
        """[.., 3 * target_hidden] captured states -> [.., hidden]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def head(self, h):
        """Pre-norm h -> draft-vocabulary logits."""
        return self.lm_head(self.norm(h))

    def to_target(self, logits, fill: float = float("-inf")):
        """Draft-vocabulary logits [.., N] -> target-vocabulary [.., V], `fill` outside the draft vocab."""
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), fill)
        return out.index_copy_(-1, self.used_ids, logits)

    def step(self, tokens, hidden, positions, cache: DraftKV | None = None, mask=None, last: bool = False):
        """One inference forward. tokens [B, T], hidden [B, T, H] (fused or a previous h),
        positions [B, T]; mask bool [T, len(cache) + T] (True = attend), causal when None.
        Appends to `cache`. Returns (draft-vocab logits [B, T, N], pre-norm h [B, T, H]); last:
        the last row's logits only, [B, 1, N] (a catch-up reads no other: the output layer is
        ~45% of a long one's time)."""
        m = self.midlayer
        q, k, v = m.self_attn.qkv(m.attn_input(self.embed(tokens), hidden), positions)
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None:
            t, s = q.shape[2], k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril_(s - t)
        a = nn.functional.scaled_dot_product_attention(
            q, m.self_attn.expand(k), m.self_attn.expand(v), attn_mask=mask.to(q.device))
        h = m.finish(hidden, a)
        return self.head(h[:, -1:] if last else h), h

    def unroll(self, input_ids, aux, steps: int, attention_mask=None, skip: int = 0,
               logits: bool = True):
        """Training-time test (see the module docstring). Returns [(logits, h)] per step.

        Steps j >= 1 are computed only at indices t >= `skip` (their outputs cover skip..T-1):
        a training batch needs them only where a label exists, and a prompt has none, so this
        saves the prompt's share of every later step. `logits=False` returns (None, h) and
        leaves the output layer to the caller (applied to the labelled rows only)."""
        b, t = input_ids.shape
        dev = input_ids.device
        m, att = self.midlayer, self.midlayer.self_attn
        pad = torch.zeros(b, steps, dtype=input_ids.dtype, device=dev)
        ids = torch.cat((input_ids, pad), dim=1)
        pos = torch.arange(t, device=dev)[None].expand(b, t)
        keep = torch.ones(t, t, dtype=torch.bool, device=dev).tril_()[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, None, :]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        hidden, keys, vals, outs = self.fuse(aux), [], [], []
        for j in range(steps):
            a0 = 0 if j == 0 else skip  # first index computed at this step
            if j == 1 and skip:
                hidden = hidden[:, skip:]
            tok = ids[:, a0 + 1 + j: 1 + j + t]
            q, k, v = att.qkv(m.attn_input(self.embed(tok), hidden), pos[:, a0:] + j)
            k, v = att.expand(k), att.expand(v)
            if j == 0:
                k0, v0 = k, v
            else:  # later steps see only their own entry at t: keep the rows t >= skip
                keys.append(k)
                vals.append(v)
            s0 = (q @ k0.transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~keep[:, :, a0:], torch.finfo(s0.dtype).min)
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys]
            w = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            a = w[..., :t] @ v0
            for i, vv in enumerate(vals):
                a = a + w[..., t + i: t + i + 1] * vv
            hidden = m.finish(hidden, a)
            outs.append((self.head(hidden) if logits else None, hidden))
        return outs
