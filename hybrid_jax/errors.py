"""Errors a user can act on. Each names the problem; none is a traceback from deep inside jax."""


class HybridJaxError(ValueError):
    """Base class of the errors raised for bad input (checkpoints, configs, prompts, parameters)."""


class ConfigError(HybridJaxError):
    """A config.json that this project cannot map: unknown model_type or layer type, bad values."""


class CheckpointError(HybridJaxError):
    """Missing, corrupt or mismatched checkpoint files."""


class InputError(HybridJaxError):
    """Bad request input: empty prompt, token id outside the vocabulary, bad sampling parameters."""
