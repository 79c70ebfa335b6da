"""Models: resolve a target or draft to a directory (resolve, named_targets), read its weights
and tokenizer (weights), check that a stand-alone draft fits its target (pair), name weights by
their identity (fingerprint), and the architecture and layout facts the forward relies on
(arch, target_layout). Session (session) loads a pair in those stages.

This module only re-exports the names callers import from `decoding.models`.
"""

from decoding.models.errors import ModelError  # noqa: F401
from decoding.models.named_targets import (  # noqa: F401
    CACHE_ENV, DEFAULT_TARGET, DEFAULT_TARGET_NAME, NAMED, cache_root, convert_gguf, default_target_dir, gguf_target_dir,
    named_target_dir, smollm2_gguf_path,
)
from decoding.models.resolve import gguf_source, resolve_model_dir  # noqa: F401
from decoding.models.fingerprint import (  # noqa: F401
    FINGERPRINT_VERSION, fingerprint, same_model, stale_fingerprint, weights_sample_sha256,
)
from decoding.models.weights import DTYPES, load_tokenizer, make_shareable, read_model, set_head_dtype  # noqa: F401
from decoding.models.pair import PROBE_TEXTS, ModelPair, check_pair, small_draft_config  # noqa: F401

# the stand-alone draft's pruned output layer (decoding.drafts.pruned); its load_model reads any
# model directory, a stand-alone draft's pruned head put back
from decoding.drafts.pruned import (  # noqa: F401
    MASKED_LOGIT, PRUNED_HEAD_TYPE, PrunedHead, PrunedHeadLlamaConfig, PrunedHeadLlamaForCausalLM, load_model,
    output_token_ids,
)
