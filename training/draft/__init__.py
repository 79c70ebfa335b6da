"""The feature-level (EAGLE-3) draft stage: vocabulary, feature cache, training, evaluation."""
