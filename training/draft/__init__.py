"""The stand-alone draft: its distillation (`python -m training.distill`, which hands a config
of run.kind eagle3 to the feature head's trainer in training/head/), the teacher's logits
(teacher_cache), its batches (data), the losses aimed at acceptance (accept_metrics, shared with
the head) and the LightningModule (module), its evaluation (evaluate), data scaling
(scaling) and output-layer shrinking (shrink_head). The corpora are training/corpus/; its
step cost is benched by training.bench.draft_cost."""
