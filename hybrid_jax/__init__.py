"""hybrid-jax: serving hybrid-attention LLMs in JAX."""
