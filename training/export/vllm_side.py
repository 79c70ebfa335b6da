"""The vLLM half of the serve-check, run by .venv-vllm's python (imports only vLLM and the
standard library: specstop's own venv has another transformers). One engine per process, kept
alive while the driver alternates prompts between it and specstop's engine, so both are timed
in the same minutes of a shared machine.

    python vllm_side.py REQUEST.json       (then one JSON line per prompt on stdin)

REQUEST: {"target": DIR, "draft": DIR | null, "model": DIR | null, "dtype": "float32",
"max_tokens": 96, "speculative_tokens": 3, "eos": [ids], "max_model_len": 1024, "warmup": [ids]}.
`model`: a speculators-format head dir given as the model (vLLM finds the target and head in its
config, as `vllm serve DIR` does). The engine is built, warmed up on `warmup`, and announced with
one line {"ready": true, "vllm": version, "construct_s": s}; then each stdin line {"ids": [...]}
gets one line {"outputs": [ids], "seconds": s, "accepted": n, "drafted": n} (batch 1, greedy;
seconds: generation only; accepted / drafted: vLLM's spec-decode counters around the prompt).
End of stdin ends the process. Any failure answers {"error": "..."} and exits 1. vLLM's own
output goes to stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def counter(llm, name: str) -> int:
    total = 0
    for m in llm.get_metrics():
        if m.name == name:
            total += int(getattr(m, "value", 0))
    return total


def build(req: dict):
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    spec = None
    if req.get("draft"):
        spec = {"method": "eagle3", "model": req["draft"], "num_speculative_tokens": req["speculative_tokens"]}
    llm = LLM(model=req.get("model") or req["target"], dtype=req["dtype"], speculative_config=spec, seed=0,
              max_model_len=req.get("max_model_len", 1024), skip_tokenizer_init=True,
              disable_log_stats=False, max_num_seqs=1)
    built = time.perf_counter() - t0
    # no tokenizer in vLLM (specstop tokenised the prompts): EOS comes from the request
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                            stop_token_ids=req.get("eos") or None)
    return llm, params, built


def generate(llm, params, ids: list[int], speculative: bool) -> dict:
    from vllm.inputs import TokensPrompt

    a0 = counter(llm, "vllm:spec_decode_num_accepted_tokens") if speculative else 0
    d0 = counter(llm, "vllm:spec_decode_num_draft_tokens") if speculative else 0
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    out = {"seconds": time.perf_counter() - t, "outputs": list(res[0].outputs[0].token_ids),
           "accepted": 0, "drafted": 0}
    if speculative:
        out["accepted"] = counter(llm, "vllm:spec_decode_num_accepted_tokens") - a0
        out["drafted"] = counter(llm, "vllm:spec_decode_num_draft_tokens") - d0
    return out


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # anything else printed goes to stderr

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        import vllm

        req = json.loads(open(argv[1]).read())
        speculative = bool(req.get("draft") or req.get("model"))
        llm, params, built = build(req)
        generate(llm, params, req["warmup"], speculative)
        say({"ready": True, "vllm": vllm.__version__, "construct_s": built})
        for line in sys.stdin:
            if line.strip():
                say(generate(llm, params, json.loads(line)["ids"], speculative))
        return 0
    except Exception as e:  # reported to the driver in one line, the trace on stderr
        traceback.print_exc()
        say({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
