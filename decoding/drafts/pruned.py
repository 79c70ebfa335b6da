"""A stand-alone draft whose output layer scores only the target's frequent tokens
(saved by `save_draft_weights` in the standard format of decoding/drafts/format.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.drafts.format import OldDraftFormat, head_ids_of, refuse_old_format, standard_config, write_head_ids
from decoding.models.errors import ModelError
from decoding.models.weights import auto_from_pretrained, read_model

# The draft's step cost is dominated by its V x H output layer (49152 x 256 for the default
# pair: ~half its step). A head over the K most frequent tokens, scattered back into a
# full-width logits row, keeps the engine and check_pair unchanged: tokens outside the head
# get a very low logit (q = 0 after softmax), so they are never proposed, and verification
# stays exactly lossless. Stored as a stock LlamaForCausalLM + the kept ids in
# specstop_draft.json (decoding/drafts/format.py); load_model() puts this head back.
PRUNED_HEAD_TYPE = "specstop_pruned_llama"
MASKED_LOGIT = -1.0e4
"""Logit of tokens the pruned head cannot propose: finite (no NaN in p*log q), exp() == 0."""


class PrunedHeadLlamaConfig(LlamaConfig):
    """LlamaConfig plus `head_size`: how many token ids the output layer scores."""

    model_type = PRUNED_HEAD_TYPE
    fingerprint_architecture = "llama"  # its weights are a stock Llama's (decoding.models.fingerprint)

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


def load_model(path, dtype: str = "float32", device: str = "cpu", head_dtype: str | None = None):
    """A causal LM from a local directory (decoding.models.weights.read_model), a specstop
    stand-alone draft with its pruned output layer (head_ids in specstop_draft.json) put back:
    what `decoding.models.load_model` is."""
    return read_model(path, dtype, device, head_dtype, build=_build)


def _build(p: Path, kw: dict):
    try:
        refuse_old_format(p)
    except OldDraftFormat as e:
        raise ModelError(str(e)) from None
    ids = head_ids_of(p)
    if ids is None:
        return auto_from_pretrained(p, kw)
    conf = PrunedHeadLlamaConfig(head_size=len(ids), **LlamaConfig.from_pretrained(p).to_dict())
    model, info = PrunedHeadLlamaForCausalLM.from_pretrained(p, config=conf, **kw)
    model.set_head_ids(ids)
    return model, info


def output_token_ids(model) -> torch.Tensor | None:
    """Token ids a draft's output layer can propose (None = all of them)."""
    head = model.get_output_embeddings()
    return head.ids if isinstance(head, PrunedHead) else None


def save_draft_weights(model, out: Path) -> list[int] | None:
    """Write `model` to `out` as a stock LlamaForCausalLM (config.json, generation_config.json,
    model.safetensors) and return its kept head ids (None = full head) for specstop_draft.json."""
    from safetensors.torch import save_file

    head = model.get_output_embeddings()
    if not isinstance(head, PrunedHead):
        model.save_pretrained(out, safe_serialization=True)
        return None
    if model.get_input_embeddings().weight is not head.weight:
        raise ValueError("a pruned-head draft must tie its output layer to the embedding")
    ids = head.ids.tolist()
    full = ids == list(range(head.weight.shape[0]))
    dtype = head.weight.dtype
    # the tied head is the embedding (transformers stores it once); the ids go to the JSON
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
             if k not in ("lm_head.weight", "lm_head.ids")}
    out.mkdir(parents=True, exist_ok=True)
    standard_config(model.config, dtype).save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return None if full else ids


def with_recorded_head(model):
    """`model` as its draft directory defines it: a stand-alone draft loaded by plain transformers
    (AutoModelForCausalLM) has the full tied output layer, while its directory's specstop_draft.json
    records the pruned head it was trained, measured and fit deciders with (and its fingerprint
    names). Returns a view proposing from those ids that shares every weight with `model` (the
    caller's object keeps its own head); any other model is returned as it is."""
    import copy

    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    src = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if isinstance(head, PrunedHead) or not src.is_dir() or not isinstance(head, torch.nn.Linear) \
            or head.bias is not None or emb is None or head.weight is not emb.weight:
        return model  # only a stock tied head over the loaded embedding can be the recorded one
    try:
        ids = head_ids_of(src)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if ids is None:
        return model
    vocab, hidden = emb.weight.shape
    if not ids or min(ids) < 0 or max(ids) >= vocab or len(set(ids)) != len(ids):
        raise ModelError(f"{src}: head_ids must be unique token ids below {vocab}")
    with torch.device("meta"):  # its weight is the loaded embedding: allocate nothing
        pruned = PrunedHead(vocab, hidden, len(ids))
    pruned.weight = emb.weight
    pruned.ids = torch.tensor(ids, dtype=torch.long, device=emb.weight.device)
    view = copy.copy(model)
    view._modules = dict(model._modules)  # its own module table: `model` keeps its head
    view.set_output_embeddings(pruned)
    return view
