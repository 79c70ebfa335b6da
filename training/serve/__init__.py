"""The exported head in the engines users serve with: `make serve-check` (check.py drives,
vllm_side.py runs in vLLM's own venv) and the re-distillation gate's use of it (gate.py)."""
