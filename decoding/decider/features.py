"""THE decider feature schema: one function used by trace collection, training and inference.

Every feature is computed from draft-side information only (what the draft saw and drew),
so a stop decision based on them never changes what verification commits. Bump
FEATURE_SCHEMA_VERSION whenever a feature's meaning or order changes: checkpoints record
it and inference refuses a decider trained on another schema.
"""

from __future__ import annotations

import torch

from decoding.decider.context import CONTEXT_NAMES, SCHEMA_CONTEXT
from decoding.stopping import DraftLevel

FEATURE_SCHEMA_VERSION = 3
TOP_K = 10
FEATURE_NAMES = (
    ["q_entropy"] + [f"q_top{i + 1}" for i in range(TOP_K)]  # the paper's 11 features
    + ["q_token", "token_rank", "depth", "branch", "path_logq", "log_position"]
    + list(CONTEXT_NAMES)  # schemas 2 and 3: what the text so far says (decoding.decider.context)
)
SCHEMA_COLUMNS = {v: 17 + n for v, n in SCHEMA_CONTEXT.items()}
"""Columns of each schema: every schema appends to the one before, so a decider trained on an
older schema reads the first SCHEMA_COLUMNS[its schema] columns of this one."""
PAPER_FEATURES = slice(0, 1 + TOP_K)
NUM_FEATURES = len(FEATURE_NAMES)
# named groups of columns, for the fit's ablation (which features carry signal)
FEATURE_GROUPS = {
    "paper: entropy + top-10 of the parent's q": list(range(PAPER_FEATURES.start, PAPER_FEATURES.stop)),
    **{name: [FEATURE_NAMES.index(name)] for name in ("q_token", "token_rank", "path_logq", "log_position")},
    "tree position: depth, branch": [FEATURE_NAMES.index("depth"), FEATURE_NAMES.index("branch")],
    "context: n-gram lookups, token seen": [FEATURE_NAMES.index(n) for n in CONTEXT_NAMES[:SCHEMA_CONTEXT[2]]],
    "context+: match lengths, continuation shares, counts":
        [FEATURE_NAMES.index(n) for n in CONTEXT_NAMES[SCHEMA_CONTEXT[2]:]],
}


def node_features(level: DraftLevel) -> torch.Tensor:
    """[k, NUM_FEATURES] float32 features for the k nodes of one drafted level."""
    q = level.parent_q.float()
    dev = q.device  # every tensor made here goes where the draft's q lives (cpu or cuda)
    entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1, keepdim=True)  # vectorised (entr is not: 8x slower)
    top = level.parent_top[:, :TOP_K].float() if level.parent_top is not None \
        else q.topk(min(TOP_K, q.shape[-1]), dim=-1).values
    if top.shape[-1] < TOP_K:  # tiny vocabularies (tests)
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
    per_parent = torch.cat([entropy, top], dim=-1)[level.parent_of]
    q_tok = level.q_token.float().to(dev)
    # rank of the drawn token in its parent's distribution (0 = the draft's argmax): every
    # token above a top-10 token is itself in the top 10, so a full pass is needed only for
    # tokens drawn from outside it (sampling); this runs once per drafted level
    tops = top[level.parent_of]
    rank = (tops > q_tok[:, None]).sum(-1).float()
    far = q_tok < tops[:, -1]
    if far.any():
        rows = torch.tensor(level.parent_of, device=dev)[far]
        rank[far] = (q[rows] > q_tok[far, None]).sum(-1).float()
    k = len(level.nodes)
    per_node = torch.stack([
        q_tok,
        rank,
        torch.full((k,), float(level.depth), device=dev),
        torch.tensor(level.branch, dtype=torch.float32, device=dev),
        level.path_logq.float().to(dev),
        torch.full((k,), float(torch.log1p(torch.tensor(float(level.position), device="cpu"))), device=dev),
    ], dim=-1)
    return torch.cat([per_parent, per_node, context_features(level, dev)], dim=-1)


def context_features(level: DraftLevel, dev) -> torch.Tensor:
    """[k, len(CONTEXT_NAMES)] decoding.decider.context's columns as the level's drafting saw them (zeros for a level
    built by hand, as in unit tests), on `dev`."""
    if level.context is None or level.prefixes is None:
        return torch.zeros(len(level.nodes), len(CONTEXT_NAMES), device=dev)
    return level.context.features(level.prefixes, level.tokens).to(dev)


def node_hidden(level: DraftLevel) -> torch.Tensor | None:
    """[k, H] the draft's last hidden state that produced each node's token (or None)."""
    if level.parent_hidden is None:
        return None
    return level.parent_hidden[level.parent_of]
