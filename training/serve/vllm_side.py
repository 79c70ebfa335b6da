"""The vLLM half of the serve-check, run by .venv-vllm's python (imports only vLLM and the
standard library: specstop's own venv has another transformers).

    python vllm_side.py REQUEST.json RESULT.json

REQUEST: {"target": DIR, "draft": DIR | null, "prompts": [[ids]], "max_tokens": 96,
"dtypes": ["float32", ...], "speculative_tokens": 3, "eos": [ids], "max_model_len": 1024,
"speculators": DIR | null}. For each dtype,
plain vLLM and (with a draft) vLLM + the EAGLE-3 head generate greedily, one prompt at a time
(batch 1, as specstop's engine). RESULT: per dtype and mode the new token ids, seconds per
prompt (generation only) and, with the head, the draft tokens accepted per prompt (the
difference of vLLM's spec-decode counter around each prompt), plus the construction seconds.
Any failure writes {"error": "..."} and exits 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def counter(llm, name: str) -> int:
    total = 0
    for m in llm.get_metrics():
        if m.name == name:
            total += int(getattr(m, "value", 0))
    return total


def run_mode(req: dict, dtype: str, draft: str | None, model: str | None = None) -> dict:
    """model: a speculators-format head dir given as the model (vLLM finds target and head
    in its config, as `vllm serve DIR` does)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    spec = None
    if draft:
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": req["speculative_tokens"]}
    llm = LLM(model=model or req["target"], dtype=dtype, speculative_config=spec, seed=0,
              max_model_len=req.get("max_model_len", 1024), skip_tokenizer_init=True,
              disable_log_stats=False, max_num_seqs=1)
    built = time.perf_counter() - t0
    # no tokenizer in vLLM (specstop tokenised the prompts): EOS comes from the request
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                            stop_token_ids=req.get("eos") or None)
    llm.generate([TokensPrompt(prompt_token_ids=req["prompts"][0])], params, use_tqdm=False)  # warm-up
    out = {"outputs": [], "seconds": [], "accepted": [], "drafted": [], "construct_s": built}
    for ids in req["prompts"]:
        draft = draft or model
        a0 = counter(llm, "vllm:spec_decode_num_accepted_tokens") if draft else 0
        d0 = counter(llm, "vllm:spec_decode_num_draft_tokens") if draft else 0
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        out["seconds"].append(time.perf_counter() - t)
        out["outputs"].append(list(res[0].outputs[0].token_ids))
        if draft:
            out["accepted"].append(counter(llm, "vllm:spec_decode_num_accepted_tokens") - a0)
            out["drafted"].append(counter(llm, "vllm:spec_decode_num_draft_tokens") - d0)
    del llm
    return out


def main(argv: list[str]) -> int:
    req_path, res_path = argv[1], argv[2]
    req = json.loads(open(req_path).read())
    result: dict = {"vllm": None, "runs": {}}
    try:
        import vllm

        result["vllm"] = vllm.__version__
        for dtype in req["dtypes"]:
            for mode, draft in (("plain", None), ("head", req.get("draft"))):
                if mode == "head" and not draft:
                    continue
                print(f"vllm_side: {dtype} {mode} ...", file=sys.stderr, flush=True)
                result["runs"][f"{dtype}/{mode}"] = run_mode(req, dtype, draft)
        if req.get("speculators"):  # the `vllm serve DIR` path, fp32: part of the contract
            print("vllm_side: float32 speculators ...", file=sys.stderr, flush=True)
            result["runs"]["float32/speculators"] = run_mode(req, "float32", None, req["speculators"])
        rc = 0
    except Exception as e:  # reported to the driver in one line, the trace on stderr
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rc = 1
    with open(res_path, "w") as f:
        json.dump(result, f)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
