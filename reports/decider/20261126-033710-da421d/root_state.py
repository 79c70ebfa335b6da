"""Does the target's own state at the round root carry signal beyond the decider's features?

A one-off ablation (2026-11-26), kept beside its output (root_state.json) as its provenance:

    .venv/bin/python reports/decider/20261126-033710-da421d/root_state.py \
        runs/traces-eagle3c runs/traces-eagle3c-heldout

For each traced prompt the committed text is regenerated exactly as `training.collect` ran it
(ti-mcsd W4 D8, bf16, greedy: deterministic; every accepted node is checked against it), then one
target forward over prompt + text gives, for each round, the entropy and top probability of the
target distribution that produced the anchor token (known before the round is drafted, so a
decider could use it losslessly). A logistic regression on the decider features with and without
those two columns, fitted on the training traces, is scored by node ROC-AUC (greedy_match, valid
nodes) on the held-out traces."""
import json, sys, numpy as np, torch
sys.path.insert(0, ".")  # run from the repository root
torch.set_num_threads(2)
from decoding.api import Decoder
from decoding.sampling import SamplingConfig
from decoding.features import FEATURE_NAMES
from training.decider.traces import load_traces, feature_matrix
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from sklearn.metrics import roc_auc_score

prompts = {}
for f in ["data/prompts/val.jsonl", "runs/heldout24_general.jsonl", "runs/heldout24_code.jsonl"]:
    for line in open(f):
        r = json.loads(line); prompts[r["id"]] = r["prompt"]
dec = Decoder.load(strategy="ti-mcsd", width=4, depth=8, stop="fixed", dtype="bfloat16")  # as collected: the same committed text
eng = dec.engine(SamplingConfig(0.0, 1.0))
tok = dec.tokenizer
model = dec.session.target

def root_state(table):
    pid = np.array(table.column("prompt_id").to_pylist())
    pos = table.column("position").to_numpy(); dep = table.column("depth").to_numpy()
    acc = table.column("accepted").to_numpy(zero_copy_only=False); tk = table.column("token").to_numpy()
    out = np.full((len(pid), 2), np.nan, np.float32)
    ok_prompts = 0
    for p in np.unique(pid):
        ids = dec.prompt_ids(prompts[p], chat=True)
        cont, _ = eng.generate(ids, max_new_tokens=96, eos_token_id=tok.eos_token_id, seed=0)
        rows = np.flatnonzero(pid == p)
        a = rows[acc[rows]]
        idx = pos[a] + dep[a] - 1
        inside = idx < len(cont)
        good = np.array([cont[i] for i in idx[inside]]) == tk[a][inside]
        if len(a) and good.mean() < 0.99:
            continue  # the continuation diverged from the traced one (a bf16 tie): skip the prompt
        ok_prompts += 1
        with torch.inference_mode():
            lg = model(input_ids=torch.tensor([ids + cont])).logits[0].float()
        lp = torch.log_softmax(lg, -1); pr = lp.exp()
        ent = -(pr * lp).sum(-1).numpy(); top = pr.max(-1).values.numpy()
        n0 = len(ids)
        j = n0 + pos[rows] - 2  # the row predicting the anchor (committed index n0 + pos - 1)
        out[rows, 0] = ent[j]; out[rows, 1] = top[j]
    print(f"{ok_prompts} of {len(np.unique(pid))} prompts aligned", file=sys.stderr)
    return out

def xy(path):
    m, t = load_traces(path)
    X = feature_matrix(t); R = root_state(t)
    v = t.column("valid").to_numpy(zero_copy_only=False) & ~np.isnan(R[:, 0])
    y = t.column("greedy_match").to_numpy(zero_copy_only=False).astype(int)
    return X[v], R[v], y[v]

Xtr, Rtr, ytr = xy(sys.argv[1]); Xte, Rte, yte = xy(sys.argv[2])
res = {}
Q = FEATURE_NAMES.index("q_token")
for name, (A, B) in {"features": (Xtr, Xte), "features+root": (np.c_[Xtr, Rtr], np.c_[Xte, Rte]),
                     "root alone": (Rtr, Rte), "q alone": (Xtr[:, [Q]], Xte[:, [Q]])}.items():
    sc = StandardScaler().fit(A)
    clf = LogisticRegression(max_iter=2000).fit(sc.transform(A), ytr)
    res[name] = round(float(roc_auc_score(yte, clf.predict_proba(sc.transform(B))[:, 1])), 4)
print(json.dumps({"test_rows": int(len(yte)), "train_rows": int(len(ytr)), "node_roc_auc": res}, indent=1))
