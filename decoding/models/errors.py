"""The error every loader raises for a model directory or pair it cannot use."""


class ModelError(ValueError):
    """A model directory or model pair that cannot be used; the message is user-facing."""
