"""The feature (EAGLE-3) head's training: the target's features and labels (cache, data,
vocab), the training-time-test module and its trainer (module, train; run by `python -m
training.distill` for a run.kind eagle3 config), the committed training chunks that carry a run
across machines (chunks: the format; chunk_run: writing, scoring and resuming them), where a
training step's time goes (profile), and its re-distillation behind a gate (redistill; what a
run reads: redistill_config). Its benches are training.bench (head, compare, positions)."""
