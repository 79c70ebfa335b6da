"""Which longer context columns carry signal beyond feature schema 2? The one-off ablation
(2026-11-26) that chose feature schema 3's columns, kept beside its output (ablation.json):

    .venv/bin/python reports/decider/context3/ablation.py runs/traces-ctx runs/traces-ctx-heldout [TEXTS.json]

The traces are schema-2 greedy float32 traces of the default pair (W4 D8, 96 new tokens; the
decider 20261126-064054-0ff3ae's). The committed text of every traced prompt is regenerated
with the collection's engine (cached in TEXTS.json), prompts whose accepted nodes disagree with
it would be skipped (none are). For every drafted node, from the committed text before its
round and its ancestors (occurrences counted in the committed text only, as decoding.context
does), candidate columns: the latest occurrence of the last n tokens (n = 1..8) and what it
says; the longest match (up to 16) and the longest that continues with the token, and what
the latest longest match says; whether that match lies in the prompt and how far back; the
share of the last n tokens' occurrences that continue with the token (n = 1..3); log counts.
A logistic regression and gradient boosting on the 21 schema-2 columns plus each group, fitted
on the training traces, are scored by node ROC-AUC (greedy_match, valid nodes) on the held-out
traces, overall and per domain (general g-*, code humaneval-*)."""
import glob, json, os, sys
sys.path.insert(0, ".")  # run from the repository root
import numpy as np, pyarrow.parquet as pq, torch
torch.set_num_threads(2)
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler

MAXL = 16
NAMES = [f"ng{n}" for n in range(1, 9)] + ["Lsay", "Lany", "Llong_says", "long_in_prompt", "long_logdist",
         "ratio1", "ratio2", "ratio3", "logcnt1", "logcnt2", "tok_logcount", "ctx_len"]


def table(d):  # schema-2 traces, read directly (this code's load_traces wants schema 3)
    return __import__("pyarrow").concat_tables([pq.read_table(f) for f in sorted(glob.glob(f"{d}/shard-*.parquet"))])


def texts_for(dirs, cache):
    if os.path.exists(cache):
        return json.load(open(cache))
    from decoding.api import Decoder
    from decoding.sampling import SamplingConfig
    prompts = {}
    for f in ["data/prompts/val.jsonl", "runs/heldout24_general.jsonl", "runs/heldout24_code.jsonl"]:
        for line in open(f):
            r = json.loads(line); prompts[r["id"]] = r["prompt"]
    dec = Decoder.load(strategy="ti-mcsd", width=4, depth=8, stop="fixed", dtype="float32")  # as collected
    eng = dec.engine(SamplingConfig(0.0, 1.0))
    out = {}
    for d in dirs:
        for p in sorted(set(table(d).column("prompt_id").to_pylist())):
            ids = dec.prompt_ids(prompts[p], chat=True)
            cont, _ = eng.generate(ids, max_new_tokens=96, eos_token_id=dec.tokenizer.eos_token_id, seed=0)
            out[p] = {"ids": ids, "cont": [int(t) for t in cont]}
    json.dump(out, open(cache, "w"))
    return out


def feats(ctx, t, P, upto):
    n = len(ctx)
    cand = np.arange(1, n)  # continuation positions i (ctx[i] follows ctx[:i])
    lens, alive = np.zeros(n - 1, np.int32), np.ones(n - 1, bool)
    for k in range(1, MAXL + 1):
        ok = cand - k >= 0
        eq = np.zeros(n - 1, bool)
        eq[ok] = ctx[cand[ok] - k] == ctx[n - k] if n - k >= 0 else False
        alive &= eq
        if not alive.any():
            break
        lens += alive
    lens[upto - 1:] = 0  # continuations in the committed text only
    nxt = ctx[1:]
    says = nxt == t
    out = []
    for m in range(1, 9):
        idx = np.flatnonzero(lens >= m)
        out.append(0.0 if not len(idx) else (1.0 if nxt[idx[-1]] == t else -1.0))
    Lsay = float(lens[says].max()) if says.any() else 0.0
    Lany = float(lens.max()) if len(lens) else 0.0
    if Lany > 0:
        i = np.flatnonzero(lens == Lany)[-1]
        out += [Lsay, Lany, 1.0 if nxt[i] == t else -1.0, float(i + 1 <= P), float(np.log(n - i))]
    else:
        out += [Lsay, Lany, 0.0, 0.0, 0.0]
    for m in (1, 2, 3):
        sel = lens >= m
        c = sel.sum()
        out.append(float((says & sel).sum() / c) if c else -1.0)
    out += [float(np.log1p((lens >= m).sum())) for m in (1, 2)]
    return out + [float(np.log1p((ctx == t).sum())), float(np.log(n))]


def build(d, texts):
    tb = table(d)
    pid = np.array(tb.column("prompt_id").to_pylist())
    rnd, node, par, pos, tk, dep = (tb.column(c).to_numpy() for c in ("round", "node", "parent", "position", "token", "depth"))
    acc = tb.column("accepted").to_numpy(zero_copy_only=False)
    X = np.array(tb.column("features").to_pylist(), np.float32)
    G = np.full((len(pid), len(NAMES)), np.nan, np.float32)
    for p in np.unique(pid):
        ids, cont = texts[p]["ids"], texts[p]["cont"]
        rows = np.flatnonzero(pid == p)
        a = rows[acc[rows]]
        idx = pos[a] + dep[a] - 1
        inside = idx < len(cont)
        if len(a) and (np.array([cont[i] for i in idx[inside]]) == tk[a][inside]).mean() < 0.99:
            continue  # diverged from the traced text
        full = np.array(ids + cont)
        where = {(rnd[i], node[i]): i for i in rows}
        for i in rows:
            path, j = [], i
            while par[j] >= 0:
                j = where[(rnd[i], par[j])]
                path.append(tk[j])
            ctx = np.concatenate([full[: len(ids) + pos[i]], np.array(path[::-1], dtype=full.dtype)])
            G[i] = feats(ctx, int(tk[i]), len(ids), len(ids) + pos[i])
    v = tb.column("valid").to_numpy(zero_copy_only=False) & ~np.isnan(G[:, 0])
    y = tb.column("greedy_match").to_numpy(zero_copy_only=False).astype(int)
    return X[v], G[v], y[v], np.array([s[:1] for s in pid])[v]


texts = texts_for(sys.argv[1:3], sys.argv[3] if len(sys.argv) > 3 else "/tmp/context3_texts.json")
(Xtr, Gtr, ytr, _), (Xte, Gte, yte, dte) = build(sys.argv[1], texts), build(sys.argv[2], texts)
assert (Xte[:, 17:20] == Gte[:, :3]).all(), "the recomputed 1-3-gram lookups must equal the traced columns"
ix = lambda names: [NAMES.index(n) for n in names]
groups = {
    "schema 2 (21 columns)": [],
    "+ latest occurrence, n = 4..8": ix([f"ng{n}" for n in range(4, 9)]),
    "+ match lengths, what the longest says": ix(["Lsay", "Lany", "Llong_says"]),
    "+ where the longest match lies": ix(["Llong_says", "long_in_prompt", "long_logdist"]),
    "+ continuation shares, log counts": ix(["ratio1", "ratio2", "ratio3", "logcnt1", "logcnt2"]),
    "+ token count, context length": ix(["tok_logcount", "ctx_len"]),
    "+ every candidate": list(range(len(NAMES))),
    "+ schema 3's choice": ix(["Lsay", "Lany", "Llong_says", "ratio1", "ratio2", "ratio3", "logcnt1", "tok_logcount"]),
}


def auc(s):
    return {dom: round(float(roc_auc_score(yte[m], s[m])), 4)
            for dom, m in (("all", slice(None)), ("general", dte == "g"), ("code", dte == "h"))}


res = {"q alone": auc(Xte[:, 11])}
for name, g in groups.items():
    A, B = np.c_[Xtr, Gtr[:, g]], np.c_[Xte, Gte[:, g]]
    sc = StandardScaler().fit(A)
    lr = LogisticRegression(max_iter=3000).fit(sc.transform(A), ytr).predict_proba(sc.transform(B))[:, 1]
    gb = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0).fit(A, ytr).predict_proba(B)[:, 1]
    res[name] = {"logistic": auc(lr), "gradient boosting": auc(gb)}
    print(name, res[name], flush=True)
out = {"train_rows": int(len(ytr)), "test_rows": int(len(yte)), "node_roc_auc": res}
(__import__("pathlib").Path(__file__).parent / "ablation.json").write_text(json.dumps(out, indent=1))
