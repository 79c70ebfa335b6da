"""Does the context's own repetition (what prompt-lookup decoding reads) carry signal beyond the
decider's features? A one-off ablation (2026-11-26), kept beside its output (ngram.json):

    .venv/bin/python reports/decider/20261126-033710-da421d/ngram.py \
        runs/traces-eagle3c runs/traces-eagle3c-heldout

The committed text of every traced prompt is regenerated as root_state.py does (the collection's
engine and dtype, greedy; prompts whose accepted nodes disagree with it are skipped). For each
drafted node, with the context the draft saw (prompt, committed text, the node's ancestors): for
n = 1, 2, 3, does the most recent earlier occurrence of the context's last n tokens continue with
the node's token (+1), with another token (-1), or not occur (0); and does the token occur in the
context at all. Known before verification, so a decider could use them losslessly. A logistic
regression on the decider features with and without them, fitted on the training traces, is
scored by node ROC-AUC (greedy_match, valid nodes) on the held-out traces."""
import json, sys
sys.path.insert(0, ".")  # run from the repository root
import numpy as np, torch
torch.set_num_threads(2)
from decoding.api import Decoder
from decoding.features import FEATURE_NAMES
from decoding.sampling import SamplingConfig
from training.decider.traces import feature_matrix, load_traces
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler

prompts = {}
for f in ["data/prompts/val.jsonl", "runs/heldout24_general.jsonl", "runs/heldout24_code.jsonl"]:
    for line in open(f):
        r = json.loads(line); prompts[r["id"]] = r["prompt"]
dec = Decoder.load(strategy="ti-mcsd", width=4, depth=8, stop="fixed", dtype="bfloat16")  # as collected
eng = dec.engine(SamplingConfig(0.0, 1.0))
NGRAMS = (1, 2, 3)


def lookup(ctx: np.ndarray, tok: int) -> list[float]:
    out = []
    for n in NGRAMS:
        if len(ctx) <= n:
            out.append(0.0); continue
        tail = ctx[-n:]
        hit = np.ones(len(ctx) - n, bool)  # windows ctx[i:i+n], i + n < len(ctx): a continuation exists
        for j in range(n):
            hit &= ctx[j:len(ctx) - n + j] == tail[j]
        idx = np.flatnonzero(hit)
        out.append(0.0 if not len(idx) else (1.0 if ctx[idx[-1] + n] == tok else -1.0))
    out.append(float((ctx == tok).any()))
    return out


def ngram(table):
    pid = np.array(table.column("prompt_id").to_pylist())
    rnd, node, par = (table.column(c).to_numpy() for c in ("round", "node", "parent"))
    pos, tk = table.column("position").to_numpy(), table.column("token").to_numpy()
    acc, dep = table.column("accepted").to_numpy(zero_copy_only=False), table.column("depth").to_numpy()
    out = np.full((len(pid), len(NGRAMS) + 1), np.nan, np.float32)
    ok = 0
    for p in np.unique(pid):
        ids = dec.prompt_ids(prompts[p], chat=True)
        cont, _ = eng.generate(ids, max_new_tokens=96, eos_token_id=dec.tokenizer.eos_token_id, seed=0)
        rows = np.flatnonzero(pid == p)
        a = rows[acc[rows]]
        idx = pos[a] + dep[a] - 1
        inside = idx < len(cont)
        if len(a) and (np.array([cont[i] for i in idx[inside]]) == tk[a][inside]).mean() < 0.99:
            continue  # diverged from the traced text (a bf16 tie)
        ok += 1
        full = np.array(ids + cont)
        where = {(rnd[i], node[i]): i for i in rows}
        for i in rows:
            path, j = [], i
            while par[j] >= 0:
                j = where[(rnd[i], par[j])]
                path.append(tk[j])
            ctx = np.concatenate([full[: len(ids) + pos[i]], np.array(path[::-1], dtype=full.dtype)])
            out[i] = lookup(ctx, int(tk[i]))
    print(f"{ok} of {len(np.unique(pid))} prompts aligned", file=sys.stderr)
    return out


def xy(path):
    _, t = load_traces(path)
    X, G = feature_matrix(t), ngram(t)
    v = t.column("valid").to_numpy(zero_copy_only=False) & ~np.isnan(G[:, 0])
    return X[v], G[v], t.column("greedy_match").to_numpy(zero_copy_only=False).astype(int)[v]


Xtr, Gtr, ytr = xy(sys.argv[1]); Xte, Gte, yte = xy(sys.argv[2])
Q = FEATURE_NAMES.index("q_token")
res = {}
for name, (A, B) in {"features": (Xtr, Xte), "features+ngram": (np.c_[Xtr, Gtr], np.c_[Xte, Gte]),
                     "ngram alone": (Gtr, Gte), "q alone": (Xtr[:, [Q]], Xte[:, [Q]])}.items():
    sc = StandardScaler().fit(A)
    clf = LogisticRegression(max_iter=2000).fit(sc.transform(A), ytr)
    res[name] = round(float(roc_auc_score(yte, clf.predict_proba(sc.transform(B))[:, 1])), 4)
hit = {f"ngram{n} says the token": float(yte[Gte[:, k] == 1].mean()) for k, n in enumerate(NGRAMS)}
share = {f"ngram{n} predicts (share of nodes)": float((Gte[:, k] == 1).mean()) for k, n in enumerate(NGRAMS)}
out = {"test_rows": int(len(yte)), "train_rows": int(len(ytr)), "node_roc_auc": res,
       "match_rate_where": hit, **share, "match_rate": float(yte.mean())}
(__import__("pathlib").Path(__file__).parent / "ngram.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
