"""Functional building blocks of the models: pure functions of (params, arrays)."""
