"""The decider stage: trace sets, the Lightning module and its data, metrics, replay, thresholds, registry."""
