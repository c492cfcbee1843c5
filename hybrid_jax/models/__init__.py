"""Model families. Each module: `forward`, `init_params` (deterministic random init) and
`convert_hf_weights` (the one-time re-layout of a Hugging Face checkpoint)."""
