"""The head for other serving engines, and the checks that they serve it as specstop does.

Export (`python -m training.export`): formats.py writes the eagle3 and speculators layouts
(vLLM, SGLang) and dispatches gguf to gguf_head.py (llama.cpp); eagle3_import.py reads every
layout back; eagle3_layout.py says whether an engine's EAGLE-3 can compute what ours computes.
The contract checks: `make serve-check` (check.py drives, paired.py alternates the runs,
vllm_side.py runs in vLLM's own venv, report.py writes the results), `make llama-check`
(llama_check.py), and the re-distillation's promotion gate (gate.py)."""
