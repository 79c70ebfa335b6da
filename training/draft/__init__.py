"""The draft stage: teacher corpus and logits, distillation of a stand-alone draft and of a
feature-level (EAGLE-3) head, their evaluation, cost and vocabulary tools."""
