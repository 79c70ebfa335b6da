"""Synthetic trace sets with a known label rule, written like training.decider.collect writes them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from decoding.decider.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, NUM_FEATURES
from decoding.models import FINGERPRINT_VERSION
from training.shards import ShardWriter
from training.decider.traces import KIND, SCHEMA, SCHEMA_VERSION

Q_TOKEN = FEATURE_NAMES.index("q_token")
Q_ENTROPY = FEATURE_NAMES.index("q_entropy")
PAIR = {role: {"name": f"synth-{role}", "fingerprint_version": FINGERPRINT_VERSION,
               "config_sha256": role[0], "weights_sha256": role[0], "vocab_size": 64}
        for role in ("target", "draft")}  # decoding.models.fingerprint's shape, of no real model


def identity(width: int, depth: int, pair=PAIR, feature_schema=FEATURE_SCHEMA_VERSION) -> dict:
    return {"feature_schema": feature_schema, "feature_names": list(FEATURE_NAMES), "model_pair": pair,
            "collect": {"strategy": "ti-mcsd", "width": width, "depth": depth, "temperature": 0.0}}


def synth_rows(prompt_ids, rounds=8, width=3, depth=4, noise=0.05, hidden=0, seed=0,
               entropy_weight=0.5) -> pa.Table:
    """Fork trees (width x depth). Rule: greedy_match iff
        q_token - entropy_weight * (q_entropy - 1.5) + N(0, noise) > 0.5,
    with q_entropy ~ U(0, 3) independent of q_token: the parent's entropy carries a signal q
    does not (q alone reaches a ROC-AUC of ~0.72, the rule ~0.99), so a decider must use it
    to beat the confidence baseline. A round accepts the first matching root and then its
    chain while it matches. With `hidden`, the hidden state carries (q, entropy, noise...)."""
    rng = np.random.default_rng(seed)
    cols = {c: [] for c in SCHEMA.names}
    for pid in prompt_ids:
        for r in range(rounds):
            n = width * depth
            q = rng.uniform(0.0, 1.0, n)
            ent = rng.uniform(0.0, 3.0, n)
            margin = q - entropy_weight * (ent - 1.5) - 0.5
            gm = margin + rng.normal(0.0, noise, n) > 0

            valid = np.ones(n, bool)
            if rng.random() < 0.2:  # the last candidate could not be drawn: its chain is invalid
                valid[width - 1::width] = False
            gm &= valid
            path, b = [], next((b for b in range(width) if gm[b]), None)
            if b is not None:
                for d in range(depth):
                    if not gm[d * width + b]:
                        break
                    path.append(d * width + b)
            feats = rng.normal(0.0, 1.0, (n, NUM_FEATURES)).astype(np.float32)
            feats[:, Q_TOKEN] = q
            feats[:, Q_ENTROPY] = ent
            logq = np.cumsum(np.log(q.reshape(depth, width)), axis=0).reshape(-1)
            for i in range(n):
                d, br = i // width + 1, i % width
                soft = 1.0 / (1.0 + np.exp(-margin[i] / noise))
                feats[i, FEATURE_NAMES.index("depth")] = d
                feats[i, FEATURE_NAMES.index("branch")] = br
                feats[i, FEATURE_NAMES.index("path_logq")] = logq[i]
                row = {"prompt_id": pid, "round": r, "position": 5 * r, "node": i,
                       "parent": -1 if d == 1 else i - width, "depth": d, "branch": br,
                       "token": int(rng.integers(64)), "valid": bool(valid[i]),
                       "features": feats[i].tolist(),
                       "hidden": (np.r_[q[i], ent[i], rng.normal(0, 1, hidden - 2)].astype(np.float16).tobytes()
                                  if hidden else None),
                       "p_x": float(soft * q[i]), "q_x": float(q[i]), "soft_label": float(soft),
                       "greedy_match": bool(gm[i]), "accepted": i in path,
                       "round_depth": depth, "round_accepted": len(path)}
                for k, v in row.items():
                    cols[k].append(v)
    return pa.table(cols, schema=SCHEMA)


def write_traces(path, n_prompts=60, prefix="p", per_shard=20, width=3, depth=4, pair=PAIR,
                 hidden=0, seed=0, **kw):
    ids = [f"{prefix}{i:03d}" for i in range(n_prompts)]
    with ShardWriter(path, KIND, SCHEMA_VERSION, identity(width, depth, pair, **kw)) as w:
        for s in range(0, n_prompts, per_shard):
            chunk = ids[s:s + per_shard]
            w.write(synth_rows(chunk, width=width, depth=depth, hidden=hidden, seed=seed + s), chunk)
    return path
