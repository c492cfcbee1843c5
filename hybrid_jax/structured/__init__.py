"""Structured outputs: grammar-constrained decoding (issue 52)."""
